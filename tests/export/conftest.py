import pytest

from kvedge.export import ExportOptions, export

MAX_SEQ = 64


@pytest.fixture(scope="session")
def exported(tmp_path_factory, hf_checkpoint):
    """exported(case, lowering, **options) -> export folder, one per combination per session."""
    made = {}

    def get(case: str, lowering: str, **kw):
        key = (case, lowering, tuple(sorted(kw.items())))
        if key not in made:
            path, _ = hf_checkpoint(case)
            out = tmp_path_factory.mktemp(f"{case}-{lowering}")
            opts = ExportOptions(attention=lowering, max_seq_len=MAX_SEQ, max_batch=3, force=True, **kw)
            made[key] = (out, export(path, out, opts))
        return made[key]

    return get
