"""Prometheus text exposition of the engine's numbers."""
from __future__ import annotations

# name -> (type, help); snapshot keys without an entry are exported as gauges with a generic help line
METRICS = {
    "queue_length": ("gauge", "Requests waiting for a slot."),
    "running": ("gauge", "Requests in the running batch."),
    "max_batch": ("gauge", "Slots in the running batch."),
    "tokens_per_second": ("gauge", "Generated tokens per second over the last 10 s of decode steps."),
    "cache_used_fraction": ("gauge", "Fraction of the cache's token rows held by running requests."),
    "cache_held_fraction": ("gauge", "Fraction of the cache's token rows holding tokens (running or cached prefixes)."),
    "prefix_hit_rate": ("gauge", "Prompt tokens served from the prefix cache / all prompt tokens."),
    "weights_version": ("gauge", "Checkpoint step of the weights in use."),
    "requests": ("counter", "Requests admitted."),
    "prompt_tokens": ("counter", "Prompt tokens admitted."),
    "cached_tokens": ("counter", "Prompt tokens whose cache rows were reused."),
    "generated_tokens": ("counter", "Tokens generated."),
    "finished_stop": ("counter", "Requests ended by a stop token or string."),
    "finished_length": ("counter", "Requests ended by max_tokens."),
    "finished_abort": ("counter", "Requests cancelled (client gone) or failed."),
}
PREFIX = "glm5_serve_"


def prometheus_text(values: dict) -> str:
    lines = []
    for key, value in values.items():
        kind, help_text = METRICS.get(key, ("gauge", key.replace("_", " ") + "."))
        name = PREFIX + key + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
    return "\n".join(lines) + "\n"
