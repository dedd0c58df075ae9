"""Backend.forward's first_row, on every CPU backend: the B input rows run on cache rows first_row.., and a row's
results do not depend on which row it is, on what other rows hold or on what its own slots past its length
hold (the scheduler relies on all three: padding lands there, and a freed row keeps its last request's cache);
nor, on onnxruntime and native, bitwise, on how many rows run with it."""

from __future__ import annotations

import pytest
import torch

from kvedge.errors import KvedgeError
from tests.serve.conftest import BACKENDS

PROMPT = [0, 17, 99, 42, 5, 230, 64, 8, 150, 33]


def run(backend, row: int, batch: int = 1) -> list[torch.Tensor]:
    """PROMPT's prefill then 3 decode steps on cache row `row`, as one of `batch` rows starting at row 0 for the
    decode steps (the others get padding at slot 0) and alone for the prefill; the logits of each step."""
    out = [backend.forward(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], torch.tensor([len(PROMPT) - 1]),
                           first_row=row)[0, 0].clone()]
    lo = row if batch == 1 else 0
    for step, token in enumerate([7, 11, 13]):
        ids, pos = torch.zeros(batch, 1, dtype=torch.long), torch.zeros(batch, 1, dtype=torch.long)
        ids[row - lo], pos[row - lo] = token, len(PROMPT) + step
        out.append(backend.forward(ids, pos, torch.zeros(batch, dtype=torch.long), first_row=lo)[row - lo, 0].clone())
    return out


@pytest.mark.parametrize("name", BACKENDS)
def test_a_row_computes_the_same_on_any_row_over_stale_cache_contents(name, open_session):
    backend = open_session(name, 3).backend
    backend.reset()
    clean = run(backend, 0)
    g = torch.Generator().manual_seed(0)
    for t in backend.cache_tensors():  # every slot holds garbage, as a freed row holds its last request's cache
        t.copy_((torch.randn(t.shape, generator=g) * 3).to(t.dtype))
    before = [t.clone() for t in backend.cache_tensors()]
    on_row_2 = run(backend, 2)
    assert all(torch.equal(a, b) for a, b in zip(on_row_2, clean))
    for t, b in zip(backend.cache_tensors(), before):  # rows 0 and 1 untouched
        assert torch.equal(t[:2], b[:2]) and not torch.equal(t[2], b[2])
    # decoding among padded rows (row 2 of a batch of 3) gives the same logits: bitwise on onnxruntime and native;
    # torch's CPU matrix products take another kernel for 3 rows than for 1, within float rounding
    among = run(backend, 2, batch=3)
    if name == "torch":
        assert all(torch.allclose(a, b, rtol=0, atol=1e-5 * float(b.abs().max())) for a, b in zip(among, clean))
    else:
        assert all(torch.equal(a, b) for a, b in zip(among, clean))


@pytest.mark.parametrize("name", BACKENDS)
def test_rows_past_max_batch_are_refused(name, open_session):
    backend = open_session(name, 2).backend
    one = (torch.tensor([[5]]), torch.tensor([[0]]), torch.tensor([0]))
    with pytest.raises(KvedgeError, match="outside this session's max_batch 2"):
        backend.forward(*one, first_row=2)
    with pytest.raises(KvedgeError, match="exceeds max_batch 2"):
        backend.forward(torch.tensor([[5]] * 3), torch.tensor([[0]] * 3), torch.tensor([0] * 3))


@pytest.mark.parametrize("name", BACKENDS)
def test_a_prompt_prefilled_among_longer_ones_computes_as_alone(name, open_session):
    """A batch of prompts of different lengths, right-padded to the longest (as Session.prefill and kvedge serve
    run them): each row's logits equal its prompt's run alone, bitwise on onnxruntime and native. Query blocks of a
    padded row hold padding queries too; the engine scores a key alike whether its pair partner is the next key or
    itself (a last odd key), so a row's scores do not depend on where the chunk ends."""
    backend = open_session(name, 3).backend
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (12, 9, 7)]
    alone = [backend.forward(torch.tensor([p]), torch.arange(len(p))[None], torch.tensor([len(p) - 1]),
                             first_row=r)[0, 0].clone() for r, p in enumerate(prompts)]
    ids = torch.zeros(3, 12, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p)
    together = backend.forward(ids, torch.arange(12).expand(3, -1).contiguous(),
                               torch.tensor([len(p) - 1 for p in prompts]))[:, 0]
    for a, b in zip(together, alone):
        if name == "torch":  # another kernel for another batch size: float rounding
            assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))
        else:
            assert torch.equal(a, b)
