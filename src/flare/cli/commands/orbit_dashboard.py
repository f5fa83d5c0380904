"""`flare orbit dashboard`'s view: per running group, its ranks and rank zero's serving metrics."""

from __future__ import annotations

SHOWN = (("flare_num_requests_running", "running"), ("flare_num_requests_waiting", "waiting"),
         ("flare_requests_total", "finished requests"), ("flare_generation_tokens_total", "generated tokens"),
         ("flare_kv_cache_usage_ratio", "KV use"))


def metric_values(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        try:
            values[base] = values.get(base, 0.0) + float(value)
        except ValueError:
            continue
    return values


def render(controller, rows) -> str:
    from flare.errors import FlareError
    from flare.orbit.messages import Metrics

    if not rows:
        return "no group runs on these nodes"
    lines = []
    for group in sorted({state.group for _, state in rows}):
        ranks = sorted(((node, state) for node, state in rows if state.group == group), key=lambda r: r[1].rank)
        lines.append(f"{group}: " + ", ".join(f"rank {s.rank} on {n.name}" for n, s in ranks))
        zero_node, zero = ranks[0]
        try:
            with controller.session(zero_node) as agent:
                values = metric_values(agent.ask(Metrics(group)).text)
            shown = [f"{label} {values[name]:g}" for name, label in SHOWN if name in values]
            lines.append(f"  {zero.listener}: " + ("; ".join(shown) or "no metrics yet"))
        except FlareError as error:
            lines.append(f"  metrics unavailable: {error}")
    return "\n".join(lines)
