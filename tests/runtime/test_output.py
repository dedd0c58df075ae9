"""kvedge.runtime.tokenizer.Output, the per-sequence state Session and kvedge serve share: its tokens, text and
finish reason checked by hand on a character tokenizer (the serve tests compare the scheduler with Session, which
both use Output, so they cannot catch its mistakes)."""

from __future__ import annotations

from kvedge.runtime.tokenizer import Output

CHARS = "abcdefghijklmnopqrstuvwxyz ."
EOS = len(CHARS)  # an id past the characters, decoded as nothing


class Chars:
    """One character per id; EOS decodes to nothing (a special token skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(CHARS[i] for i in ids if i != EOS)


def ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def run(tokens: list[int], max_tokens: int, stop=(), tokenizer=Chars()) -> tuple[Output, list[str]]:
    out, pieces = Output(tokenizer, stop, frozenset([EOS]), max_tokens), []
    for t in tokens:
        pieces.append(out.add(t))
        if out.finish is not None:
            break
    return out, pieces


def test_length_hands_out_everything_including_a_held_back_stop_prefix():
    out, pieces = run(ids("hello wo"), 8, stop=("wor",))
    assert out.finish == "length" and out.tokens == ids("hello wo")
    assert "".join(pieces) == out.text.text == "hello wo"
    assert pieces[-3:] == [" ", "", "wo"]  # "w" waited (it could have begun "wor"); the last token flushed it


def test_a_stop_string_cuts_the_text_and_ends_the_sequence_at_its_last_token():
    out, pieces = run(ids("say stop now"), 20, stop=("stop",))
    assert out.finish == "stop" and out.tokens == ids("say stop")
    assert "".join(pieces) == out.text.text == "say "


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop():
    out, pieces = run(ids("ab.cd"), 5, stop=("cd",))
    assert out.finish == "stop" and "".join(pieces) == "ab."


def test_eos_ends_with_its_token_kept_and_no_text():
    out, pieces = run(ids("hi") + [EOS] + ids("zz"), 10)
    assert out.finish == "eos" and out.tokens == ids("hi") + [EOS]
    assert "".join(pieces) == out.text.text == "hi"


def test_eos_on_the_last_allowed_token_is_an_eos():
    out, _ = run(ids("abc") + [EOS], 4)
    assert out.finish == "eos" and len(out.tokens) == 4


def test_without_a_tokenizer_only_tokens_and_reasons():
    out, pieces = run(ids("abc") + [EOS], 10, tokenizer=None)
    assert (out.finish, out.tokens, out.text, pieces) == ("eos", ids("abc") + [EOS], None, ["", "", "", ""])
    out, _ = run(ids("abcdef"), 3, tokenizer=None)
    assert (out.finish, out.tokens) == ("length", ids("abc"))
