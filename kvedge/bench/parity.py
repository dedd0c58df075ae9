"""`kvedge parity`: a backend against the PyTorch reference, step by step.

Both run the same prompt; every decode step feeds both the reference's greedy token (teacher
forcing), so the per-step figures compare like with like. For each step: max abs and max relative
logit error, cosine, top-1 agreement. The greedy sequences are also run free, to report whether they
agree and the first step at which they diverge. Tolerances are per dtype (kvedge.runtime.compare, which
export verification uses too) and can be overridden.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from kvedge.runtime import compare as cmp
from kvedge.runtime.session import Session


@dataclass
class Step:
    step: int
    max_abs: float
    max_rel: float
    cosine: float
    top1_agree: bool
    ok: bool


@dataclass
class ParityReport:
    backend: str
    reference: str
    dtype: str
    tolerance: dict
    steps: list[Step] = field(default_factory=list)
    first_failing_step: int | None = None
    greedy_agree: bool = True
    first_divergent_step: int | None = None

    @property
    def passed(self) -> bool:
        return self.first_failing_step is None and self.greedy_agree

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d

    def markdown(self) -> str:
        lines = [f"# kvedge parity: {self.backend} vs {self.reference} ({self.dtype})", "",
                 f"**{'PASSED' if self.passed else 'FAILED'}**. Tolerance: max |error| <= "
                 f"{self.tolerance['max_rel']:g} x max(1, largest |logit|), cosine >= {self.tolerance['min_cosine']}.",
                 f"Greedy sequences {'agree' if self.greedy_agree else 'diverge'}"
                 + ("" if self.first_divergent_step is None else f" from step {self.first_divergent_step}") + ".",
                 "", "| step | max abs | max rel | cosine | top-1 | ok |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {s.step} | {s.max_abs:.3e} | {s.max_rel:.3e} | {s.cosine:.6f} | {'yes' if s.top1_agree else 'no'} "
                  f"| {'yes' if s.ok else '**no**'} |" for s in self.steps]
        return "\n".join(lines) + "\n"


@torch.inference_mode()
def compare(candidate: Session, reference: Session, prompt: list[int], steps: int, dtype: str = "fp32",
            tolerance: dict | None = None) -> ParityReport:
    tol = cmp.tolerance(dtype, tolerance)
    rep = ParityReport(candidate.backend.name, reference.backend.name, dtype, tol)
    got, ref = candidate.prefill([prompt]).float(), reference.prefill([prompt]).float()
    for step in range(steps + 1):
        fig = cmp.step(got, ref)
        s = Step(step, fig.max_abs, fig.max_rel, fig.cosine, fig.top1_agree, fig.ok(tol))
        rep.steps.append(s)
        if not s.ok and rep.first_failing_step is None:
            rep.first_failing_step = step
        if step == steps:
            break
        nxt = ref.argmax(-1)  # teacher forcing on the reference's greedy token
        got, ref = candidate.decode(nxt).float(), reference.decode(nxt).float()
    a = candidate.generate([prompt], max_new_tokens=steps + 1, eos_token_id=None).tokens[0]
    b = reference.generate([prompt], max_new_tokens=steps + 1, eos_token_id=None).tokens[0]
    diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    rep.greedy_agree, rep.first_divergent_step = diverge is None, diverge
    return rep
