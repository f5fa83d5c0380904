"""`flare inspect` and `flare models`: stable JSON, verified and unverified modes, cache management."""

from __future__ import annotations

import json


from flare.cli.flare import main


def _json(capsys, argv):
    assert main(argv) == 0
    return capsys.readouterr().out


def test_inspect_json_is_stable_and_exact(export, capsys):
    entry = export()
    first = _json(capsys, ["inspect", str(entry), "--json", "--all"])
    second = _json(capsys, ["inspect", str(entry), "--json", "--all"])
    assert first == second
    report = json.loads(first)
    assert list(report)[:4] == ["verification", "model", "capacities", "cache_history"]
    assert report["verification"]["mode"] == "verified" and report["verification"]["accepted"] is False
    assert report["model"]["checkpoint_revision"] is None                     # nulls are kept
    assert report["capacities"]["memory_reserve_bytes"] == 0                  # explicit zeroes are kept
    weights = sum(p["size"] for p in report["manifest"]["payloads"] if p["kind"] == "weights")
    assert report["ranks"][0]["weight_bytes"] == weights and isinstance(weights, int)
    # stories260k: 2 (K and V) x 5 layers x 4 KV heads x head_dim 8 x 4 bytes
    assert report["capacities"]["kv_bytes_per_token"] == 2 * 5 * 4 * 8 * 4
    assert {a["name"] for a in report["frontend"]["assets"]} >= {"tokenizer.json", "config.json"}


def test_inspect_frontend_names_the_reply_parsers_and_grammar_backend(export, capsys):
    from importlib.metadata import version

    report = json.loads(_json(capsys, ["inspect", str(export()), "--json", "--frontend"]))["frontend"]
    # stories260k has no chat template: no tools to parse, no reasoning block
    assert (report["tool_parser"], report["reasoning_parser"]) == (None, None)
    assert report["grammar_backend"] == f"xgrammar {version('xgrammar')}"
    text = _json(capsys, ["inspect", str(export()), "--frontend", "--plain"])
    assert "tool parser" in text and "grammar backend" in text and "xgrammar" in text


def test_summary_json_leaves_out_detail_sections(export, capsys):
    report = json.loads(_json(capsys, ["inspect", str(export()), "--json"]))
    assert not {"memory_map", "graphs", "frontend", "manifest"} & set(report)


def test_unverified_reads_without_keys_and_says_so(export, capsys, isolated_home):
    entry = export()
    (isolated_home / ".config/flare/development-publisher.json").unlink()
    (entry / "weights/embed.safetensors").unlink()          # companions are not opened
    report = json.loads(_json(capsys, ["inspect", str(entry), "--json", "--unverified"]))
    assert report["verification"]["mode"] == "unverified" and report["verification"]["signature"] is None
    text = _json(capsys, ["inspect", str(entry), "--unverified"])
    assert "UNVERIFIED" in text
    assert main(["inspect", str(entry), "--unverified", "--trust-store", "x.toml"]) == 2


def test_text_is_80_plain_columns_when_redirected(export, capsys):
    text = _json(capsys, ["inspect", str(export()), "--all"])
    lines = text.splitlines()
    assert max(len(line) for line in lines) == 80
    assert "\x1b[" not in text
    assert any("stories260k" in line for line in lines)


def test_tensor_parallel_and_rank_selection(export, capsys):
    entry = export()
    report = json.loads(_json(capsys, ["inspect", str(entry), "--json", "--tensor-parallel", "1", "--rank", "0"]))
    assert report["deployment"]["selected_tensor_parallel"] == 1 and report["deployment"]["rank_count"] == 1
    assert main(["inspect", str(entry), "--tensor-parallel", "2"]) == 2
    assert "available sizes: 1" in capsys.readouterr().err
    assert main(["inspect", str(entry), "--rank", "3"]) == 2


def test_models_list_select_remove_and_gc(export, cache_root, capsys):
    first, second = export(), export()
    cache = ["--model-cache", str(cache_root)]
    listing = json.loads(_json(capsys, ["models", *cache, "list", "--json"]))
    versions = {v["version"]: v for v in listing["models"][0]["versions"]}
    assert listing["verification"] == "unverified"
    assert versions[second.name]["selected"] and versions[second.name]["reclaimable_bytes"] is None
    assert "selected default" in versions[second.name]["reclaimable_note"]
    older = versions[first.name]
    assert older["logical_bytes"] == versions[second.name]["logical_bytes"]
    assert older["shared_logical_bytes"] == older["logical_bytes"]          # every payload is shared
    assert older["reclaimable_bytes"] == (first / "model.safetensors").stat().st_blocks * 512
    assert main(["models", *cache, "remove", f"stories260k@{second.name}"]) == 2
    assert "selected default" in capsys.readouterr().err
    _json(capsys, ["models", *cache, "select", f"stories260k@{first.name}"])
    _json(capsys, ["models", *cache, "remove", f"stories260k@{second.name}"])
    assert not second.exists()
    gc = json.loads(_json(capsys, ["models", *cache, "gc", "--json"]))
    assert gc["removed_blobs"] == []                                       # the remaining entry uses them all
    report = json.loads(_json(capsys, ["models", "inspect", "stories260k", "--model-cache", str(cache_root), "--json"]))
    assert report["model"]["version"] == first.name


def test_models_list_text_groups_versions(export, cache_root, capsys):
    export()
    text = _json(capsys, ["models", "--model-cache", str(cache_root), "list", "--plain"])
    assert "stories260k (unverified metadata)" in text and "default" in text


class _Terminal:
    """A stand-in for a terminal on stdout."""

    def __init__(self):
        import io
        self.buffer = io.StringIO()

    def write(self, text):
        return self.buffer.write(text)

    def flush(self):
        pass

    def isatty(self):
        return True


def _inspect_on_terminal(entry, monkeypatch, term):
    monkeypatch.setenv("TERM", term)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    assert main(["inspect", str(entry)]) == 0
    return terminal.buffer.getvalue()


def test_terminal_output_is_styled_with_the_name_banner(export, monkeypatch):
    text = _inspect_on_terminal(export(), monkeypatch, "xterm-256color")
    assert "\x1b[" in text and "█" in text and "┌─" in text


def test_term_dumb_disables_styling(export, monkeypatch):
    text = _inspect_on_terminal(export(), monkeypatch, "dumb")
    assert "\x1b[" not in text and "█" not in text and "stories260k" in text
