"""Where an engine step's time goes, without attaching a profiler (`bench throughput --profile`).

``StepProfiler`` wraps a few engine methods on one engine instance (a clock read before
and after each: ~1 us a call) and the runner's own phase timers, and sorts every step into
decode-only or mixed. ``PartTimer`` adds forward hooks on the model's modules for one
extra pass, to split the forward into attention / MLP / norms / LM head.

    step = schedule + execute[inputs, vision, forward, logits, sampling] + update + outputs
    (vision = token embedding + vision tower + merge; logits = LM head)
    efficiency = (vision + forward + logits) / step        (model math over everything)
    overhead   = step - vision - forward - logits - sampling  (what the engine adds)
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

PHASES = ("schedule", "inputs", "vision", "forward", "logits", "sampling", "update", "outputs",
          "other")


class StepProfiler:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[tuple[str, int, dict[str, float]]] = []  # (kind, batch, phases)
        self._cur: dict[str, float] = defaultdict(float)
        self._kind = ("idle", 0)
        self._undo: list[tuple[Any, str]] = []
        self._wrap(engine.scheduler, "schedule", "schedule", self._classify)
        self._wrap(engine.scheduler, "update_from_output", "update")
        self._wrap(engine.outputs, "process", "outputs")  # text, stop strings (P0's half)
        self._wrap(engine, "step", "step")

    def _classify(self, sched: Any) -> None:
        n = len(sched.scheduled)
        self._kind = ("decode" if n and sched.num_scheduled_tokens == n else "mixed", n)

    def _wrap(self, obj: Any, name: str, key: str,
              on_result: Callable[[Any], None] | None = None) -> None:
        orig = getattr(obj, name)
        runner = self.engine.runner

        def timed(*args: Any, **kwargs: Any) -> Any:
            if key == "step":
                before = dict(runner.times.totals)
                self._cur = defaultdict(float)
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            self._cur[key] += time.perf_counter() - t0
            if on_result is not None:
                on_result(out)
            if key == "step" and self._kind[1]:
                cur = self._cur
                for phase, total in runner.times.totals.items():
                    cur[phase] = total - before[phase]
                named = sum(cur[p] for p in PHASES if p != "other")
                cur["other"] = max(cur["step"] - named, 0.0)
                self.steps.append((self._kind[0], self._kind[1], dict(cur)))
                self._kind = ("idle", 0)
            return out

        setattr(obj, name, timed)
        self._undo.append((obj, name))

    def close(self) -> None:
        for obj, name in self._undo:
            if name in vars(obj):
                delattr(obj, name)  # back to the class's method

    def summary(self, kind: str, batch: int | None = None) -> dict[str, Any] | None:
        """Mean milliseconds per phase over steps of ``kind`` (and batch size)."""
        rows = [p for k, b, p in self.steps if k == kind and (batch is None or b == batch)]
        if not rows:
            return None
        mean = {ph: 1e3 * sum(r.get(ph, 0.0) for r in rows) / len(rows) for ph in PHASES}
        step = 1e3 * sum(r["step"] for r in rows) / len(rows)
        model = mean["vision"] + mean["forward"] + mean["logits"]
        overhead = step - model - mean["sampling"]
        return {"steps": len(rows), "step_ms": step, "phases_ms": mean,
                "efficiency": model / step, "overhead_frac": overhead / step,
                "overhead_wo_outputs": (overhead - mean["outputs"]) / step}


class PartTimer:
    """Forward hooks timing the model's parts (one pass; the hooks themselves cost a few us
    each, so fractions of the forward are shown, not absolute times), split by the kind of
    forward: ``decode`` (one query token per sequence) or ``prefill`` (anything else)."""

    def __init__(self, model: Any) -> None:
        from triptych.models.attention import PagedAttention
        from triptych.models.qwen2_vl import Qwen2Attention, Qwen2MLP, RMSNorm

        # totals[kind][part] seconds; part "forward" is the whole language model
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._handles = []
        parts = {Qwen2Attention: "attn block", PagedAttention: "paged attention",
                 Qwen2MLP: "mlp", RMSNorm: "rms norm"}
        self._hook(model.language_model, "forward")
        for mod in model.language_model.modules():
            name = parts.get(type(mod))
            if name is not None:
                self._hook(mod, name)

    def _hook(self, mod: Any, name: str) -> None:
        from triptych.engine.runner.forward_context import get_forward_context

        start: list[float] = []

        def pre(*_: Any) -> None:
            start.append(time.perf_counter())

        def post(*_: Any) -> None:
            kind = "decode" if get_forward_context().attn.max_query_len == 1 else "prefill"
            self.totals[kind][name] += time.perf_counter() - start.pop()

        self._handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def fractions(self, kind: str) -> dict[str, float]:
        """Share of the ``kind`` forwards' time in each part (empty if none ran)."""
        t = dict(self.totals.get(kind, {}))
        forward_s = t.pop("forward", 0.0)
        if not forward_s:
            return {}
        attn = t.pop("attn block", 0.0)
        paged = t.get("paged attention", 0.0)
        t["qkv/o proj + rope"] = attn - paged
        t["other (embed, residual, glue)"] = forward_s - sum(t.values())
        return {k: v / forward_s for k, v in t.items()}


def format_summary(title: str, s: dict[str, Any]) -> str:
    lines = [(f"{title}: {s['steps']} steps, {s['step_ms']:.2f} ms/step, efficiency "
              f"{100 * s['efficiency']:.0f}% (model / step), engine overhead "
              f"{100 * s['overhead_frac']:.1f}% ({100 * s['overhead_wo_outputs']:.1f}% without "
              "output processing)")]
    for ph, ms in s["phases_ms"].items():
        lines.append(f"    {ph:<9} {ms:8.3f} ms  {100 * ms / s['step_ms']:5.1f}%")
    return "\n".join(lines)
