"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one step.

* `history`: drafts copied from a request's own prompt and output (n-gram lookup), on the host.
* `acceptance`: verification of a row's drafts against the target distribution on the device, greedy
  rows exactly, sampled rows by rejection sampling (the output distribution is exactly the target's).
* `settings`: what a served engine speculates with (`SpeculationSettings`).

docs/architecture.md ("Speculative decoding") describes how a round flows through the core, the
scheduler and the runner.
"""
