"""Counters of speculative decoding: what the core reports in `EngineStats` and Prometheus serves.

A round is one request's step that carried drafts. Mean accepted length (tokens a round brings, the
drafts accepted plus the one drawn after them) is (accepted + rounds) / rounds; acceptance at position j
is accepted_by_position[j] / rounds that reached j.
"""

from __future__ import annotations


class SpeculationCounters:
    def __init__(self, max_draft_tokens: int) -> None:
        self.rounds = 0
        self.proposed = 0
        self.accepted = 0
        self.accepted_by_position = [0] * max_draft_tokens
        self.proposed_by_position = [0] * max_draft_tokens

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """One round: `num_drafts` verified, the first `num_accepted` of them accepted."""
        self.rounds += 1
        self.proposed += num_drafts
        self.accepted += num_accepted
        grow = num_drafts - len(self.proposed_by_position)
        if grow > 0:
            self.accepted_by_position += [0] * grow
            self.proposed_by_position += [0] * grow
        for position in range(num_drafts):
            self.proposed_by_position[position] += 1
        for position in range(num_accepted):
            self.accepted_by_position[position] += 1

    def stats(self) -> dict:
        """The EngineStats fields."""
        return {"speculative_rounds": self.rounds, "draft_tokens_proposed": self.proposed,
                "draft_tokens_accepted": self.accepted,
                "draft_tokens_accepted_by_position": tuple(self.accepted_by_position),
                "draft_tokens_proposed_by_position": tuple(self.proposed_by_position)}
