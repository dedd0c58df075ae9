"""Issue 32: the bench reports a person reads. One colour per backend in every plot (a backend's decode and TTFT
lines, at every prompt length, share it), the memory plot says how large each backend's cache is when they
differ (an export's 2048-token cache beside a checkpoint backend's 144-token one), and bench.md gives memory in
MiB, not raw bytes."""

from __future__ import annotations

import re

import pytest

from kvedge.bench import latency

MiB = 2**20


def result(backend: str, prompt_len: int, cache_tokens: int, kv_bytes: int) -> latency.Result:
    return latency.Result(backend, prompt_len, 1, 16, 10.0 + prompt_len / 100, 1000.0, 5.0, 6.0, 7.0, 5.5, 180.0,
                          180.0, 300 * MiB, kv_bytes, kv_bytes, 700 * MiB, None, kv_max_seq_len=cache_tokens,
                          kv_max_batch=1)


@pytest.fixture
def results():
    return [result(be, pl, tokens, kv) for be, tokens, kv in (("onnxruntime", 2048, 90 * MiB),
                                                              ("native", 144, 6 * MiB), ("torch", 144, 6 * MiB))
            for pl in (32, 64, 128)]


@pytest.fixture
def figures(monkeypatch):
    """The figures the report draws, kept open for inspection."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: kept.__setitem__(path.name, fig))
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    return kept


def test_each_backend_keeps_one_colour_across_plots_and_lines(results, figures, tmp_path):
    latency.write_reports(results, tmp_path, {"path": "x"})
    lines = figures["latency_vs_context.png"].axes[0].get_lines()
    colour = {}
    for line in lines:
        backend = line.get_label().split()[0]
        colour.setdefault(backend, set()).add(line.get_color())
    assert set(colour) == {"onnxruntime", "native", "torch"}
    assert all(len(c) == 1 for c in colour.values()), colour  # decode and TTFT of one backend: one colour
    assert len({next(iter(c)) for c in colour.values()}) == 3  # three backends: three colours
    bars = figures["tokens_per_s.png"].axes[0].patches
    assert len(bars) == len(results)
    by_backend = {}
    for bar, r in zip(bars, results):
        by_backend.setdefault(r.backend, set()).add(bar.get_facecolor())
    assert all(len(c) == 1 for c in by_backend.values()) and len({next(iter(c)) for c in by_backend.values()}) == 3
    assert {next(iter(by_backend[b])) for b in by_backend} == \
        {matplotlib_rgba(next(iter(colour[b]))) for b in colour}  # the same colour a backend has in the lines


def matplotlib_rgba(colour):
    from matplotlib.colors import to_rgba

    return to_rgba(colour)


def test_the_memory_plot_labels_caches_of_different_sizes(results, figures, tmp_path):
    latency.write_reports(results, tmp_path, {"path": "x"})
    ax = figures["memory.png"].axes[0]
    labels = {t.get_text() for t in ax.get_xticklabels()}
    assert any("onnxruntime" in t and "2048" in t for t in labels), labels
    assert any("native" in t and "144" in t for t in labels), labels
    assert "differ" in ax.get_title()


def test_bench_md_gives_memory_in_mib(results, tmp_path):
    latency.write_reports(results, tmp_path, {"path": "x"})
    md = (tmp_path / "bench.md").read_text()
    memory = md[md.index("Memory"):]
    assert "MiB" in memory and "90.0" in memory and "2048" in memory
    assert not re.search(r"\b\d{7,}\b", memory), memory  # no raw byte counts
