"""The scheduler without HTTP, stepped by hand: requests admitted while others prefill and decode give the
tokens, text and finish reason of the same request run alone on a plain Session (a separate backend, one-shot
prefill, batch 1); the queue is bounded; a cancelled or failed request frees its row and the others go on."""

from __future__ import annotations

import pytest
import torch

from kvedge.errors import KvedgeError
from kvedge.runtime import SamplingParams
from kvedge.serve.scheduler import Job, QueueFull, Scheduler
from tests.serve.conftest import BACKENDS, Proxy, openai_finish

LENGTHS = [5, 20, 13, 30, 3, 9]  # prompt lengths; 20 and 30 span several chunks of 8
MAX_TOKENS = [12, 6, 20, 8, 15, 10]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=3), SamplingParams(),
            SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=1.0, top_p=0.9, seed=7),
            SamplingParams()]
SUBMIT_AT = [0, 0, 0, 0, 3, 7]  # the step before which each request arrives (3 rows: the 4th waits)


def prompts(n: int = len(LENGTHS), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, 259, (k - 1,), generator=g).tolist() for k in LENGTHS[:n]]


class Recorder:
    """Collects a job's events."""

    def __init__(self):
        self.text, self.finish, self.events = "", None, 0

    def __call__(self, event):
        assert self.finish is None, "an event after the last one"
        self.text += event.text
        self.finish, self.events = event.finish, self.events + 1


def run_until_done(sched: Scheduler, jobs: list[Job], submit_at: list[int], limit: int = 2000) -> None:
    for step in range(limit):
        for job, at in zip(jobs, submit_at):
            if at == step:
                sched.submit(job)
        if step > max(submit_at) and not sched.waiting and not any(sched.rows):
            return
        sched.step()
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("name,kv_dtype", [(b, None) for b in BACKENDS] + [("native", "int8")])
def test_requests_among_others_equal_each_alone_on_a_plain_session(name, kv_dtype, open_session):
    session = open_session(name, 3, max_seq_len=64, kv_dtype=kv_dtype)  # onnxruntime: the export's 256
    logged = Proxy(session.backend)
    sched = Scheduler(logged, session.tokenizer, max_queue=4, chunk_size=8)
    ps = prompts()
    reference = open_session(name, 1, max_seq_len=64, kv_dtype=kv_dtype)
    refs = [reference.generate([p], max_new_tokens=m, sampling=s) for p, m, s in zip(ps, MAX_TOKENS, SAMPLING)]
    stop = refs[2].texts[0][3:5]  # a stop string the third request meets
    refs[2] = reference.generate([ps[2]], max_new_tokens=MAX_TOKENS[2], sampling=SAMPLING[2], stop=[stop])
    assert refs[2].finish_reasons[0] == "stop"
    eos = frozenset([session.cfg.eos_token_id])
    recs = [Recorder() for _ in ps]
    jobs = [Job(p, m, s, (stop,) if i == 2 else (), eos, rec)
            for i, (p, m, s, rec) in enumerate(zip(ps, MAX_TOKENS, SAMPLING, recs))]
    run_until_done(sched, jobs, SUBMIT_AT)
    for job, rec, ref in zip(jobs, recs, refs):
        assert job.out.tokens == ref.tokens[0]
        assert rec.text == ref.texts[0]
        assert rec.finish == openai_finish(ref.finish_reasons[0])
    # the 30-token prompt went in as 4 chunks, with decode steps of the other rows between them
    chunks = [i for i, (shape, row) in enumerate(logged.calls) if shape[1] > 1 and row == jobs[3].row]
    assert [logged.calls[i][0] for i in chunks[-4:]] == [(1, 8), (1, 8), (1, 8), (1, 6)]
    assert all(any(logged.calls[k][0][1] == 1 for k in range(a + 1, b)) for a, b in zip(chunks[-4:], chunks[-3:]))
    assert max(shape[0] for shape, _ in logged.calls) == 3  # decode steps spanned all three rows


def test_the_queue_is_bounded_past_the_free_rows(open_session):
    session = open_session("native", 2, max_seq_len=64)
    sched = Scheduler(session.backend, session.tokenizer, max_queue=1)
    jobs = [Job([0, 5, 6], 4) for _ in range(4)]
    for job in jobs[:3]:  # 2 free rows + 1 waiting
        sched.submit(job)
    with pytest.raises(QueueFull, match="retry later"):
        sched.submit(jobs[3])
    sched.step()  # two admitted, one waits: still full
    assert [j.row for j in jobs[:3]] == [0, 1, -1]
    with pytest.raises(QueueFull):
        sched.submit(jobs[3])

    sched.cancel(jobs[2])  # its client went away while it waited: its place in the queue is free at once
    assert jobs[2].finish == "cancelled" and not sched.waiting
    sched.submit(jobs[3])
    assert list(sched.waiting) == [jobs[3]]


def test_a_double_buffered_backend_is_refused(open_session):
    """A backend whose cache is double-buffered (kvedge.runtime.backend: in_place False, as TensorRT without an
    in-place cache update) leaves the rows a call skips stale; the scheduler refuses it up front."""
    session = open_session("native", 2, max_seq_len=64)
    backend = Proxy(session.backend)
    backend.name, backend.in_place = "tensorrt", False
    with pytest.raises(KvedgeError, match="double-buffers its cache"):
        Scheduler(backend, session.tokenizer)


def test_a_cancelled_request_frees_its_row_for_the_next(open_session):
    session = open_session("native", 1)
    sched = Scheduler(session.backend, session.tokenizer)
    first, second = Recorder(), Recorder()
    long = Job(prompts(1)[0], 200, emit=first)
    nxt = Job(prompts(2, seed=1)[1], 5, emit=second)
    sched.submit(long)
    sched.submit(nxt)
    for _ in range(4):
        sched.step()
    n = len(long.out.tokens)
    assert nxt.row == -1 and 4 <= n < 200
    sched.cancel(long)
    sched.step()
    assert long.finish == "cancelled" and first.finish is None  # no event to a client that is gone
    assert sched.rows == [nxt] and len(long.out.tokens) == n
    run_until_done(sched, [], [0])
    assert second.finish == "length" and len(nxt.out.tokens) == 5


def test_a_failing_request_ends_with_an_error_and_the_others_go_on(open_session):
    session = open_session("native", 2)
    failed = []

    def fail(ids, first_row):  # the first prefill chunk on row 1 fails, once
        if ids.shape[1] > 1 and first_row == 1 and not failed:
            failed.append(True)
            return True
        return False

    sched = Scheduler(Proxy(session.backend, fail), session.tokenizer)
    recs = [Recorder() for _ in range(3)]
    jobs = [Job(p, 6, emit=rec) for p, rec in zip(prompts(3), recs)]
    run_until_done(sched, jobs, [0, 0, 0])
    assert [r.finish for r in recs] == ["length", "error", "length"]
    alone = open_session("native", 1)
    for job in (jobs[0], jobs[2]):
        assert job.out.tokens == alone.generate([job.prompt], max_new_tokens=6, eos_token_id=None).tokens[0]


@pytest.mark.parametrize("name", BACKENDS)
def test_a_burst_prefills_its_consecutive_rows_together_and_each_equals_alone(name, open_session):
    """Five requests at once on five free rows, prompts of 12, 12, 10, 4 and 20 tokens (chunks of up to 64): rows
    0-2 go in as one forward padded to 12 (36 slots for 34 tokens), row 3's 4 tokens would pad that forward past a
    fifth and row 4's 20 would pad row 3's, so each runs alone; then one decode step over all five. Each request's
    tokens equal the same request on a plain Session (batch 1)."""
    session = open_session(name, 5, max_seq_len=64)
    logged = Proxy(session.backend)
    sched = Scheduler(logged, session.tokenizer, max_queue=0, chunk_size=64)
    g = torch.Generator().manual_seed(4)
    ps = [[0] + torch.randint(3, 259, (k - 1,), generator=g).tolist() for k in (12, 12, 10, 4, 20)]
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=5), SamplingParams(), SamplingParams(),
                SamplingParams(top_k=10, temperature=1.0, seed=1)]
    jobs = [Job(p, 6, s) for p, s in zip(ps, sampling)]
    run_until_done(sched, jobs, [0] * 5)
    assert logged.calls[:4] == [((3, 12), 0), ((1, 4), 3), ((1, 20), 4), ((5, 1), 0)]
    reference = open_session(name, 1, max_seq_len=64)
    for job, s in zip(jobs, sampling):
        assert job.out.tokens == reference.generate([job.prompt], max_new_tokens=6, sampling=s,
                                                    eos_token_id=None).tokens[0]
