"""`flare inspect`: a package's summary and optional detail sections, as text or stable JSON.

The report is built as an ordered dict (insertion order is the JSON key order), so `--json` is
stable: exact integers, nulls kept, explicit zeroes kept. Text renders the same data in boxes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec

from flare.errors import UsageError
from flare.package.manifest import Deployment, Manifest, Rank
from flare.package.reader import Package
from flare.package.render import Section
from flare.ui.progress import format_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class InspectOptions:
    memory_map: bool = False
    graphs: bool = False
    frontend: bool = False
    all: bool = False
    rank: int | None = None
    tensor_parallel: int | None = None


def build_report(package: Package, options: InspectOptions,
                 reply_parsers: Callable[[Path], dict] = lambda frontend_dir: {},
                 retained: dict | None = None) -> dict:
    """The report `flare inspect` prints. `reply_parsers` describes how replies are read from the
    package's frontend assets (flare.frontend.chat_template.reply_parsers: the frontend sits above this
    module, so the caller brings it); `retained` where `flare run` keeps this package's prefix states
    below the GPU (from the configuration, so the caller brings it too)."""
    manifest = package.manifest
    deployment = _select_deployment(manifest, options.tensor_parallel)
    ranks = _select_ranks(deployment, options.rank)
    report: dict = {"verification": _verification(package), "model": _model(manifest),
                    "capacities": _capacities(manifest), "cache_history": ["paged_kv"],
                    "speculation": _speculation(manifest),
                    "sampling": msgspec.to_builtins(manifest.sampling),
                    "deployment": {"name": deployment.name, "tensor_parallel": deployment.tensor_parallel,
                                   "rank_count": len(deployment.ranks),
                                   "selected_tensor_parallel": options.tensor_parallel},
                    "ranks": [_rank_summary(package, rank) for rank in ranks]}
    if retained is not None:
        report["retained_prefix_states"] = retained
    if options.memory_map or options.all:
        report["memory_map"] = _memory_map(package, ranks)
    if options.graphs or options.all:
        report["graphs"] = [{"rank": rank.rank, "catalog": _catalog(package, rank),
                             "compiled": _compiled(package, rank),
                             "speculative_programs": _programs(manifest)} for rank in ranks]
    if options.frontend or options.all:
        report["frontend"] = _frontend(package, reply_parsers)
    if options.all:
        report["package"] = {"path": str(package.path), "form": package.form,
                             "format_version": manifest.format_version, "created": manifest.created,
                             "preparation": msgspec.to_builtins(manifest.preparation)}
        report["manifest"] = manifest.to_builtins()
    return report


def _retained_text(retained: dict) -> list[tuple[str, str]]:
    host = retained["host_memory_bytes"]
    rows = [("host memory", f"{format_bytes(host)} ([prefix_cache] memory)" if host
             else "off: evicted prefixes are recomputed ([prefix_cache] memory keeps them)")]
    directory = retained["disk_directory"]
    if directory is None:
        rows.append(("disk", "off ([paths] prefix_cache keeps them across restarts)"))
        return rows
    limit = retained["disk_limit_bytes"]
    rows.append(("disk", f"{directory}, up to {format_bytes(limit) if limit else '10% of its free space'}"))
    for folder in retained["disk"] or [{"path": "(none yet)", "pages": 0, "bytes": 0}]:
        rows.append(("held", f"{folder['pages']:,} pages, {format_bytes(folder['bytes'])} in {folder['path']}"))
    return rows


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2, ensure_ascii=False)


def _verification(package: Package) -> dict:
    publisher = package.manifest.publisher
    trust = package.trust
    return {"mode": "verified" if trust else "unverified",
            "signature": "valid" if trust else None,
            "publisher": publisher.namespace, "official_source": publisher.official_source,
            "key_fingerprint": publisher.key_fingerprint,
            "key_source": trust.key_source if trust else None,
            "accepted": trust.accepted if trust else None,
            "identity": trust.identity if trust else None,
            "checked": _checked(package), "not_checked": _not_checked(package)}


def _checked(package: Package) -> list[str]:
    """What opening the package checked, in the words the text report uses."""
    if package.trust is None or package.stored_data is None:
        return ["manifest schema (primary metadata only)"]
    return ["signature", "manifest schema", *package.stored_data.checked()]


def _not_checked(package: Package) -> list[str]:
    if package.trust is None or package.stored_data is None:
        return ["signature, and every payload's size, header and bytes (--unverified opens no companion files)"]
    return package.stored_data.not_checked()


def _model(manifest: Manifest) -> dict:
    config = manifest.checkpoint.config
    return {"model_id": manifest.model_id, "served_names": list(manifest.served_names),
            "model_key": manifest.model_key, "version": manifest.version,
            "architecture": (config.get("architectures") or [None])[0],
            "recipe": manifest.recipe.name, "alias": manifest.recipe.alias,
            "checkpoint_repo": manifest.checkpoint.repo_id,
            "checkpoint_revision": manifest.checkpoint.revision,
            "repository": manifest.repository, "license": msgspec.to_builtins(manifest.license)}


def _capacities(manifest: Manifest) -> dict:
    plan = manifest.plan
    return {"dtype": plan.dtype, "weights": _weight_format(manifest), "kv_cache_dtype": plan.kv_cache_dtype,
            "max_model_len": plan.max_model_len,
            "max_concurrency": plan.max_concurrency, "decode_capacities": list(plan.decode_capacities),
            "prefill_chunk": plan.prefill_chunk, "page_size": plan.page_size,
            "prefill_attention": plan.prefill_attention,
            "kv_bytes_per_token": _kv_bytes_per_token(manifest),
            "memory_reserve_bytes": plan.memory_reserve_bytes}


def _weight_format(manifest: Manifest) -> str:
    """How the projections are stored: FP8 (the checkpoint's, or online at export), or the serving dtype."""
    from flare.models import UnsupportedModel
    from flare.models.quantization import fp8_weights_of, online_fp8

    try:
        fp8 = online_fp8(manifest.plan.online_fp8) if manifest.plan.online_fp8 else fp8_weights_of(
            manifest.checkpoint.config)
    except UnsupportedModel as error:
        return f"not servable: {error}"
    if fp8 is None:
        return f"{manifest.plan.dtype} (floating-point tensors cast at export)"
    which = f" ({', '.join(fp8.targets)})" if fp8.method == "online" else ""
    return f"{fp8.describe()}{which}; other tensors {manifest.plan.dtype}, scales float32"


def _kv_bytes_per_token(manifest: Manifest) -> int | None:
    from flare.recipes.base import kv_bytes_per_token

    config, plan = manifest.checkpoint.config, manifest.plan
    try:
        return kv_bytes_per_token(config, DTYPE_BYTES.get(plan.dtype, 2), plan.tensor_parallel, plan.kv_cache_dtype)
    except (KeyError, TypeError):
        return None


def payload_storage(record) -> dict[str, int] | None:
    """Bytes of a weight payload per stored dtype (safetensors codes: F8_E4M3, F32, BF16, ...), from its
    signed tensor list; None for payloads without one."""
    if not record.tensors:
        return None
    storage: dict[str, int] = {}
    for tensor in record.tensors:
        storage[tensor.dtype] = storage.get(tensor.dtype, 0) + tensor.data_offsets[1] - tensor.data_offsets[0]
    return dict(sorted(storage.items(), key=lambda item: -item[1]))


def _select_deployment(manifest: Manifest, tensor_parallel: int | None) -> Deployment:
    deployments = manifest.deployments
    sizes = [d.tensor_parallel for d in deployments]
    if tensor_parallel is None:
        if len(deployments) != 1:
            raise UsageError(f"the package has deployments for tensor-parallel sizes {sizes}; "
                             "choose one with --tensor-parallel N")
        return deployments[0]
    matches = [d for d in deployments if d.tensor_parallel == tensor_parallel]
    if len(matches) != 1:
        problem = "is not in" if not matches else "appears more than once in"
        raise UsageError(f"--tensor-parallel {tensor_parallel} {problem} the package; available sizes: "
                         f"{', '.join(map(str, sizes))}")
    return matches[0]


def _select_ranks(deployment: Deployment, rank: int | None) -> tuple[Rank, ...]:
    if rank is None:
        return deployment.ranks
    chosen = tuple(r for r in deployment.ranks if r.rank == rank)
    if not chosen:
        raise UsageError(f"--rank {rank}: the {deployment.name} deployment has ranks "
                         f"0 through {len(deployment.ranks) - 1}")
    return chosen


def _rank_summary(package: Package, rank: Rank) -> dict:
    catalog = _catalog(package, rank)
    storage: dict[str, int] = {}
    for record in package.weight_payloads():
        for code, size in (payload_storage(record) or {}).items():
            storage[code] = storage.get(code, 0) + size
    return {"rank": rank.rank, "weight_bytes": sum(r.size for r in package.weight_payloads()),
            "weight_storage": dict(sorted(storage.items(), key=lambda item: -item[1])) or None,
            "fixed_bytes": sum(r.size for r in package.payloads),
            "graph_count": len(catalog["captured"]) if catalog else None}


def _speculation(manifest: Manifest) -> dict | None:
    """The plan's speculation, without its program list (--graphs shows that); None: prepared without."""
    speculation = manifest.plan.speculation
    if speculation is None:
        return None
    draft = speculation.draft
    return {"draft_tokens": speculation.draft_tokens, "adaptive": speculation.adaptive,
            "token_capacity": speculation.token_capacity, "history_drafts": speculation.history,
            "draft_model": None if draft is None else {
                "kind": draft.kind, "repo_id": draft.repo_id, "revision": draft.revision,
                "layers": draft.config.get("num_hidden_layers"), "hidden_size": draft.config.get("hidden_size")}}


def _programs(manifest: Manifest) -> dict | None:
    """The speculative catalog's B/D/W/P programs, and how they run."""
    speculation = manifest.plan.speculation
    if speculation is None:
        return None
    return {"programs": [msgspec.to_builtins(program) for program in speculation.programs],
            "width_one": "every decode capacity (the decode graphs)",
            "execution": "eager: verification steps run the compiled layers without a captured graph"}


def _programs_text(programs: dict | None) -> str:
    if programs is None:
        return "none (prepared with --no-mtp, or without speculation)"
    listed = " ".join(f"{p['batch']}/{p['drafts']}/{p['width']}/{p['rows']}" for p in programs["programs"])
    return f"B/D/W/P {listed or '-'}; width one at every batch; {programs['execution']}"


def _catalog(package: Package, rank: Rank) -> dict | None:
    if package.trust is None:
        return None                                  # unverified: companion files are not opened
    for name in rank.payloads:
        if name in package.graph_catalogs:
            return msgspec.to_builtins(package.graph_catalogs[name])
    return None


def _compiled(package: Package, rank: Rank) -> dict | None:
    """What the rank carries of prepared compiled code (sizes and the environment it fits); None when
    unverified or prepared without a GPU."""
    stored = package.compiled_artifacts(rank.rank) if package.trust is not None else None
    if stored is None:
        return None
    data, key, triton_kernels, flashinfer_kernels = stored
    return {"torch_compile_bytes": len(data), "triton_kernel_bytes": len(triton_kernels),
            "flashinfer_build_bytes": len(flashinfer_kernels), "prepared_with": key}


def _prompt_steps_text(catalog: dict) -> str:
    """The prompt-step buckets serving captures as piecewise graphs, or why those steps run eagerly."""
    sizes, note = catalog.get("prompt_tokens") or [], catalog.get("prompt_note") or ""
    if not sizes:
        return "eager" + (f" ({note})" if note else " (prepared without a GPU)")
    return f"piecewise graphs at {', '.join(map(str, sizes))} tokens ({note})"


def _compiled_text(compiled: dict | None, read: bool) -> str:
    if compiled is None:
        return "none (prepared without a GPU)" if read else "not read (unverified)"
    key = compiled["prepared_with"]
    flashinfer = compiled.get("flashinfer_build_bytes")
    builds = f", {format_bytes(flashinfer)} FlashInfer" if flashinfer else ""
    return (f"{format_bytes(compiled['torch_compile_bytes'])} torch.compile, "
            f"{format_bytes(compiled['triton_kernel_bytes'])} Triton{builds}; for torch {key.get('torch')}, "
            f"Triton {key.get('triton')}, CUDA {key.get('cuda')}, {key.get('gpu')} ({key.get('capability')})")


def _memory_map(package: Package, ranks: tuple[Rank, ...]) -> list[dict]:
    result = []
    for rank in ranks:
        names = set(rank.payloads)
        payloads = []
        for record in package.payloads:
            if record.kind != "module-global" or record.name in names:
                location = package.files.locate(record)
                payloads.append({"name": record.name, "kind": record.kind, "size": record.size,
                                 "storage": payload_storage(record), "sha256": record.sha256,
                                 "file": str(location.path), "offset": location.offset})
        result.append({"rank": rank.rank, "payloads": payloads,
                       "kv_bytes_per_token": _kv_bytes_per_token(package.manifest),
                       "kv_pages": "sized at load from free device memory",
                       "cache": _cache_layout(package.manifest)})
    return result


def _cache_layout(manifest: Manifest) -> dict | None:
    """What each cached token costs, by page kind and component (flare.models.cache_spec), and one whole
    context's bytes at the prepared context and at 1,048,576 tokens; None where the config cannot say."""
    from flare.models import ModelConfig, UnsupportedModel
    from flare.models.cache_spec import cache_spec

    plan = manifest.plan
    try:
        cfg = ModelConfig.from_hf_config(manifest.checkpoint.config, online_fp8=plan.online_fp8,
                                         kv_cache_dtype=plan.kv_cache_dtype)
    except (UnsupportedModel, KeyError, TypeError):
        return None
    spec = cache_spec(cfg, plan.page_size, DTYPE_BYTES.get(plan.dtype, 2))
    kinds = {}
    for kind in ("tokens", "window"):
        components = spec.of_kind(kind)
        if not components:
            continue
        names = sorted({component.name for component in components})
        kinds[kind] = {"page_bytes": sum(c.bytes_per_page(spec.page_size) for c in components),
                       "components": {name: sum(c.bytes_per_page(spec.page_size) for c in components
                                                if c.name == name) for name in names}}
    contexts = sorted({plan.max_model_len or 0, 1 << 20} - {0})
    return {"page_size": spec.page_size, "kinds": kinds, "bytes_per_token": spec.bytes_per_token,
            "window_retention": spec.window_retention, "window_pages_per_request": spec.window_pages_per_request,
            "context_bytes": {str(tokens): spec.sequence_bytes(tokens) for tokens in contexts}}


def _frontend(package: Package, reply_parsers: Callable[[Path], dict]) -> dict:
    frontend = package.manifest.frontend
    assets = [{"name": name, "size": len(package.frontend_assets[name]) if name in package.frontend_assets
               else None} for name in frontend.assets]
    tokenizer_config = {}
    if "tokenizer_config.json" in package.frontend_assets:
        tokenizer_config = json.loads(package.frontend_assets["tokenizer_config.json"])
    has_template = bool(tokenizer_config.get("chat_template")) or any(
        name.endswith(".jinja") or name == "chat_template.json" for name in frontend.assets)
    return {"payload": frontend.payload, "assets": assets,
            "tokenizer_class": tokenizer_config.get("tokenizer_class"),
            "bos_token": tokenizer_config.get("bos_token"), "eos_token": tokenizer_config.get("eos_token"),
            "chat_template": has_template if package.trust else None, **reply_parsers(package.frontend_dir())}


# --- text --------------------------------------------------------------------------------------

def _range_text(value) -> str:
    """A [low, high] pair reads as a range; anything else as plain text."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return f"[{_text(value[0])}, {_text(value[1])}]"
    return _text(value)


def _text(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_range_text(v)}" for k, v in value.items()) or "-"
    return str(value)


def _storage_text(storage: dict[str, int] | None) -> str:
    """`F8_E4M3 94%, F32 1%, BF16 5%`: each stored dtype's share of the payload's tensor bytes."""
    if not storage:
        return "-"
    total = sum(storage.values()) or 1
    return ", ".join(f"{code} {100 * size / total:.0f}%" for code, size in storage.items())


def sections(report: dict) -> list[Section]:
    """The report's boxes: the summary every inspection shows, then the parts asked for."""
    return _summary_sections(report) + _detail_sections(report)


def _summary_sections(report: dict) -> list[Section]:
    verification, model, capacities = report["verification"], report["model"], report["capacities"]
    mode = verification["mode"]
    trust_line = ("UNVERIFIED: not checked" if mode == "unverified" else
                  f"valid; {'accepted' if verification['accepted'] else 'not accepted yet'}")
    return [
        Section("Model", [("name", model["served_names"][0] if model["served_names"] else model["model_id"]),
                          ("model id", model["model_id"]), ("served names", _text(model["served_names"])),
                          ("version", f"{model['model_key']}@{model['version']}"),
                          ("architecture", _text(model["architecture"])),
                          ("recipe", f"{_text(model['recipe'])} (alias {_text(model['alias'])})"),
                          ("checkpoint", f"{_text(model['checkpoint_repo'])}@{_text(model['checkpoint_revision'])}"),
                          ("license", _text((model["license"] or {}).get("name")))]),
        # Labels of at most nine characters leave room for the 64-digit key on one line of an 80-column box.
        Section("Publisher", [("signature", trust_line), ("namespace", verification["publisher"]),
                              ("source", _text(verification["official_source"])),
                              ("key", verification["key_fingerprint"]),
                              ("identity", _text(verification["identity"]))]),
        Section("Integrity", [("checked", "; ".join(verification["checked"])),
                              ("not checked", "; ".join(verification["not_checked"]) or "-")]),
        Section("Capacities", [("dtype", capacities["dtype"]), ("weights", capacities["weights"]),
                               ("KV cache dtype", capacities["kv_cache_dtype"]),
                               ("context", _text(capacities["max_model_len"])),
                               ("concurrency", _text(capacities["max_concurrency"])),
                               ("decode batches", _text(capacities["decode_capacities"])),
                               ("prefill chunk", _text(capacities["prefill_chunk"])),
                               ("page size", _text(capacities["page_size"])),
                               ("prompt attention", _text(capacities["prefill_attention"])),
                               ("KV per token", format_bytes(capacities["kv_bytes_per_token"])),
                               ("cache history", _text(report["cache_history"])),
                               ("speculation", _text(report["speculation"]) if report["speculation"] else "off")]),
        Section("Sampling", [("defaults", _text(report["sampling"]["defaults"])),
                             ("ranges", _text(report["sampling"]["ranges"]))]),
        *([Section("Prefix cache", _retained_text(report["retained_prefix_states"]))]
          if "retained_prefix_states" in report else []),
        Section(f"Ranks ({report['deployment']['name']})",
                table=(["rank", "weights", "stored as", "fixed", "graphs"],
                       [[str(r["rank"]), format_bytes(r["weight_bytes"]), _storage_text(r["weight_storage"]),
                         format_bytes(r["fixed_bytes"]), _text(r["graph_count"])] for r in report["ranks"]])),
    ]


def _cache_section(rank: int, cache: dict) -> Section:
    rows = [("page", f"{cache['page_size']:,} tokens"),
            ("per token", f"{cache['bytes_per_token']:,.1f} bytes (tokens pages; window pages below)")]
    for kind, layout in cache["kinds"].items():
        parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in layout["components"].items())
        rows.append((f"{kind} page", f"{format_bytes(layout['page_bytes'])}: {parts}"))
    if "window" in cache["kinds"]:
        rows.append(("window pages", f"{cache['window_pages_per_request']} per active request (a step reads "
                                     f"{cache['window_retention']:,} tokens back), plus a step's prompt tokens"))
    for tokens, size in cache["context_bytes"].items():
        rows.append((f"{int(tokens):,} tokens", f"{format_bytes(size)} for one sequence"))
    return Section(f"KV cache, rank {rank}", rows)


def _detail_sections(report: dict) -> list[Section]:
    result = []
    for rank_map in report.get("memory_map", []):
        result.append(Section(f"Memory map, rank {rank_map['rank']}",
                              table=(["payload", "kind", "bytes", "storage", "offset", "sha256"],
                                     [[p["name"], p["kind"], f"{p['size']:,}", _storage_text(p["storage"]),
                                       f"{p['offset']:,}", p["sha256"][:16]] for p in rank_map["payloads"]])))
        if rank_map.get("cache"):
            result.append(_cache_section(rank_map["rank"], rank_map["cache"]))
    for graphs in report.get("graphs", []):
        catalog = graphs["catalog"]
        result.append(Section(f"Graphs, rank {graphs['rank']}",
                              [("captured", _text(catalog.get("captured")) if catalog else "not read (unverified)"),
                               ("note", _text(catalog.get("note")) if catalog else "-"),
                               ("prompt steps", _prompt_steps_text(catalog) if catalog else "-"),
                               ("compiled kernels", _compiled_text(graphs["compiled"], catalog is not None)),
                               ("speculative", _programs_text(graphs["speculative_programs"]))]))
    if "frontend" in report:
        frontend = report["frontend"]
        rows = [("tokenizer", _text(frontend["tokenizer_class"])), ("bos / eos",
                f"{_text(frontend['bos_token'])} / {_text(frontend['eos_token'])}"),
                ("chat template", _text(frontend["chat_template"])),
                ("tool parser", _text(frontend["tool_parser"]) if frontend["tool_parser"] else "- (no tools)"),
                ("reasoning parser", _text(frontend["reasoning_parser"]) if frontend["reasoning_parser"] else "-"),
                ("grammar backend", _text(frontend["grammar_backend"]) if frontend["grammar_backend"] else "-")]
        rows += [(asset["name"], format_bytes(asset["size"]) if asset["size"] is not None else "-")
                 for asset in frontend["assets"]]
        result.append(Section("Frontend", rows))
    if "package" in report:
        package = report["package"]
        result.append(Section("Package", [("path", package["path"]), ("form", package["form"]),
                                          ("format", str(package["format_version"])),
                                          ("created", _text(package["created"]))]))
    return result
