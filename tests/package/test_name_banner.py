"""The served-name banner wraps at separators and skips names the font cannot draw."""

from flare.package.name_banner import HEIGHT, render_lines, supported, wrap


def test_wraps_at_separators_and_splits_a_word_only_when_it_must():
    assert wrap("qwen3.8-27b", 200) == ["qwen3.8-27b"]
    pieces = wrap("qwen3.8-27b-instruct", 40)
    assert "".join(pieces) == "qwen3.8-27b-instruct" and all(p.endswith(("-", ".")) for p in pieces[:-1])
    assert "".join(wrap("abcdefghijklmnop", 12)) == "abcdefghijklmnop"


def test_unsupported_characters_get_no_banner():
    assert not supported("名前") and render_lines("名前", 80) == []
    assert len(render_lines("stories260k", 200)) == HEIGHT
