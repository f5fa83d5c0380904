"""Orbit: a controller drives `flare agent`s on paired hosts (spec §2, "Orbit and multi-host serving").

    identity.py       Ed25519 identities: the controller key, each agent's key
    session.py        encrypted control sessions between them (X25519, HKDF-SHA256, ChaCha20-Poly1305)
    grants.py         signed grants: the controller's authorization of one action on one agent
    messages.py       the control protocol's messages
    orbit_file.py     the controller's registry of paired nodes, clusters and saved groups
    agent_state.py    an agent's authorized controllers and pairing code
    agent.py          the agent: answers sessions, runs ranks, stores pushed packages
    rank_processes.py the `flare run` processes an agent starts, their logs and ends
    controller.py     the client side of every `flare orbit` / `flare agent pair` command
"""
