"""The nvdnn command line: `nvdnn warm`, `nvdnn cache info|list|verify|clear|export|import`,
`nvdnn plan inspect|verify|sign`."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from . import __version__, compiler, dtypes
from . import models
from . import warm as warming
from . import bundle
from .cache import KernelCache, check_record_file
from .cache_files import atomic_write, remove
from .errors import NvdnnError, ValidationError
from .spec import FAMILIES

EXAMPLES = {
    "warm": """examples:
  nvdnn warm --arch sm_90 --preset pointwise          pre-warm for an H100/H200, no GPU needed
  nvdnn warm --arch sm_80,sm_90 --preset pointwise -j 8
  NVDNN_RECORD=specs.jsonl python train.py            record what a program compiles...
  nvdnn warm --from-record specs.jsonl --arch sm_90   ...and build exactly that elsewhere (= --spec-file)
  nvdnn warm --preset pointwise --dry-run             list what would be compiled
  nvdnn warm --arch sm_90 --preset resnet50           a whole model's kernels (batch sizes 1, 8, 32, 64)
  nvdnn warm --arch sm_90 --preset transformer --param hidden=4096 --param heads=32 \\
      --param head_dim=128 --param dtype=bf16         one decoder layer's kernels at these sizes
  nvdnn warm --preset transformer --param seq=4096 --all-candidates --dry-run

model presets and their parameters (--param KEY=VALUE, lists with commas):
""" + "\n".join(m.describe() for m in models.MODELS.values()),
    "cache": """examples:
  nvdnn cache info --json
  nvdnn cache list --family pointwise --arch sm_90
  nvdnn cache verify --repair
  NVDNN_CACHE_DIR=/tmp/k nvdnn cache clear
  nvdnn cache export kernels.tar                      ship a folder's kernels...
  NVDNN_CACHE_DIR=/srv/k nvdnn cache import kernels.tar   ...verified entry by entry""",
    "plan": """examples:
  nvdnn plan inspect model.plan                       header, kernels and their uris
  nvdnn plan verify model.plan --json                 every check deserialize makes
  head -c 32 /dev/urandom > plan.key                  a signing key (keep it secret)
  nvdnn plan sign model.plan --key-file plan.key      append an HMAC-SHA256 signature...
  nvdnn plan verify model.plan --key-file plan.key    ...and require it (or set NVDNN_PLAN_KEY_FILE)""",
}


def _emit(rows, as_json: bool, line) -> None:
    """Rows as JSON, or one formatted line each."""
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(line(row))


class _Progress:
    """A bar with counts and ETA on a terminal; one plain line per kernel otherwise."""

    def __init__(self, stream):
        self.stream, self.tty, self.started = stream, stream.isatty(), time.perf_counter()

    def __call__(self, done: int, total: int, label: str):
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (total - done)
        if self.tty:
            filled = int(30 * done / total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} "
                              f"{elapsed:5.1f}s ETA {eta:5.1f}s")
            if done == total:
                self.stream.write("\n")
        else:
            self.stream.write(f"[{done}/{total}] {label}\n")
        self.stream.flush()


def _model_plans(args, archs) -> list:
    """Plan the model presets among ``args.preset``; each --param must fit one of them."""
    names = [n for n in dict.fromkeys(args.preset or []) if n in models.MODELS]
    given = models.parse_params(args.param)
    if given and not names:
        raise NvdnnError(f"--param: only model presets ({', '.join(models.MODELS)}) take parameters", arg="param")
    for key in given:
        if not any(key in {p.name for p in models.MODELS[n].params} for n in names):
            takes = "; ".join(f"{n} takes {', '.join(p.name for p in models.MODELS[n].params)}" for n in names)
            raise NvdnnError(f"--param {key}: unknown parameter ({takes})", arg=key)
    return [models.plan_model(n, {k: v for k, v in given.items() if k in {p.name for p in models.MODELS[n].params}},
                              archs, candidates=args.all_candidates) for n in names]


def _cmd_warm(args) -> int:
    check_record_file()
    recorded = [row for path in args.spec_file or [] for row in warming.read_spec_file(path)]
    if not args.preset and not recorded:
        print("nothing to warm: give --preset or --spec-file", file=sys.stderr)
        return 2
    needs_arch = args.preset or any(arch is None for _, arch in recorded)
    archs = warming.parse_archs(args.arch) if args.arch else [compiler.device_arch()] if needs_arch else []
    family_presets = [n for n in args.preset or [] if n not in models.MODELS]
    jobs = [(spec, arch) for spec in warming.preset_specs(family_presets) for arch in archs]
    plans = _model_plans(args, archs)
    for plan in plans:
        jobs.extend(plan.jobs)
    notes = [line for plan in plans for line in plan.lines()]
    plan_failed = any(plan.failed for plan in plans)
    for spec, arch in recorded:  # a recording's own arch, unless --arch says otherwise
        jobs.extend([(spec, a) for a in archs] if args.arch or arch is None else [(spec, compiler.parse_arch(arch))])
    archs = sorted({arch for _, arch in jobs})
    cache = KernelCache()
    if args.dry_run:
        rows = [{"uri": s.uri, "arch": s.target_arch(a), "cached": cache.contains(s, a)}  # the arch it is kept for
                for s, a in dict.fromkeys(jobs)]
        _emit(rows, args.json, lambda r: f"{'cached ' if r['cached'] else 'compile'} {r['arch']:7} {r['uri']}")
        if notes:  # model presets: what was planned and skipped (stderr beside a JSON list)
            print("\n".join(notes), file=sys.stderr if args.json else sys.stdout)
        return 1 if plan_failed else 0
    progress = None if args.json else _Progress(sys.stderr)
    report = warming.warm(jobs, cache, workers=args.jobs or 0, progress=progress)
    summary = report.as_dict() | {"folder": str(cache.folder), "archs": archs}
    if plans:
        summary["models"] = [plan.as_dict() for plan in plans]
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"warmed {cache.folder} for {', '.join(archs)}: compiled {summary['compiled']}, "
              f"already cached {summary['cached']}, failed {summary['failed']}, not written "
              f"{summary['unwritten']} in {summary['seconds']:.2f}s")
        for failure in report.failed:
            print(f"  FAILED {failure[0]}\n    " + failure[1].replace("\n", "\n    "))
        if report.unwritten:
            print(f"  NOT WRITTEN: {len(report.unwritten)} kernels compiled but not stored in {cache.folder} "
                  "(not writable? set NVDNN_CACHE_DIR), e.g. " + report.unwritten[0])
        if notes:
            print("\n".join(notes))
    return 1 if report.failed or report.unwritten or plan_failed else 0


def _cmd_cache(args) -> int:
    cache = KernelCache()
    if args.action == "info":
        info = cache.info()
        if args.json:
            print(json.dumps(info, indent=1))
        else:
            print(f"folder   {info['folder']}\nentries  {info['entries']} ({info['bad']} bad)\n"
                  f"size     {info['bytes'] / 1e6:.2f} MB\nNVRTC    {info['nvrtc']}")
        return 0
    if args.action in ("export", "import"):
        if not args.file:
            print(f"nvdnn cache {args.action}: give the bundle FILE", file=sys.stderr)
            return 2
        folder = Path(args.file).absolute().parent
        if args.action == "export" and not folder.is_dir():
            raise ValidationError(f"cache export: {args.file}: folder {folder} does not exist", arg="file")
        result = (bundle.export_bundle if args.action == "export" else bundle.import_bundle)(cache, args.file)
        print(json.dumps(result) if args.json else ", ".join(f"{k} {v}" for k, v in result.items()))
        return 0
    if args.action == "clear":
        removed = cache.clear()
        print(json.dumps({"removed": removed}) if args.json else f"removed {removed} files from {cache.folder}")
        return 0
    rows, bad = [], []
    dtype = dtypes.dtype(args.dtype, arg="dtype").name if args.dtype else None
    arch = compiler.parse_arch(args.arch) if args.arch else None
    for path, entry, problem in cache.entries():
        if entry is None:
            bad.append({"file": path.name, "problem": problem})
            continue
        fields = entry.meta.get("spec", {}).get("fields", {})
        row = {"key": entry.key[:16], "uri": entry.uri, "arch": entry.arch,
               "family": entry.meta.get("family", ""), "registers": entry.meta.get("registers"),
               "spill_bytes": entry.meta.get("spill_bytes"), "bytes": len(entry.cubin)}
        if ((args.family and row["family"] != args.family) or (arch and not _loads(arch, entry.arch))
                or (dtype and dtype not in _data_types(fields))):
            continue
        rows.append(row)
    if args.action == "verify":
        if args.repair:
            for item in bad:
                remove(cache.kernels / item["file"])
        result = {"good": len(rows), "bad": bad, "repaired": bool(args.repair)}
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print(f"{len(rows)} good, {len(bad)} bad" + (" (removed)" if args.repair and bad else ""))
            for item in bad:
                print(f"  {item['file']}: {item['problem']}")
        return 1 if bad and not args.repair else 0
    _emit(rows, args.json, lambda r: f"{r['key']} {r['arch']:7} regs={r['registers']:<3} {r['uri']}")
    return 0


def _data_types(fields: dict) -> set[str]:
    """The data types a cached kernel's spec names, in any family's fields (not its index type)."""
    values = [x for name, v in fields.items() if name != "index" for x in (v if isinstance(v, list) else [v])]
    return {x for x in values if isinstance(x, str) and x in dtypes.BY_NAME}


def _loads(device_arch: str, built_for: str) -> bool:
    """Whether a device of ``device_arch`` loads a kernel built for ``built_for``: sm_90 names a
    Hopper device, which loads sm_90 and sm_90a builds; sm_90a names only the arch-specific ones."""
    suffix = built_for[len(device_arch):] if built_for.startswith(device_arch) else None
    return suffix == "" or (suffix in ("a", "f") and device_arch[-1].isdigit())


def _cmd_plan(args) -> int:
    from . import plan, plan_sign
    try:
        blob = Path(args.blob).read_bytes()
    except OSError as exc:
        raise ValidationError(f"{args.blob}: cannot read the plan blob: {exc.strerror}", arg="blob") from None
    checked = plan.check(blob)  # framing, checksum, header schema and every kernel image
    header = checked.header
    if args.action in ("sign", "verify"):
        key = plan_sign.read_key(args.key_file) if args.key_file else plan_sign.resolve(None)
    if args.action == "sign":
        if key is None:
            raise NvdnnError("plan sign: give --key-file FILE or set NVDNN_PLAN_KEY_FILE", arg="key_file")
        atomic_write(Path(args.blob), plan.sign(blob, key))
        print(json.dumps({"blob": args.blob, "signed": True}) if args.json else f"{args.blob}: signed")
        return 0
    if args.action == "verify":
        plan.deserialize(blob, key)  # every field, the graph rebuilt: nothing compiles, nothing loads
        trust = "signature verified" if key else "integrity only: " + ("signed, no key given" if checked.signed
                                                                        else "not signed")
        print(json.dumps({"blob": args.blob, "ok": True, "signed": checked.signed, "signature_verified": bool(key)})
              if args.json else f"{args.blob}: ok ({trust})")
        return 0
    info = {"blob": args.blob, "bytes": len(blob), "nvdnn_version": header.get("nvdnn_version"),
            "arch": header.get("arch"), "nvrtc": header.get("nvrtc"), "workspace_size": header.get("workspace_size"),
            "graph": header.get("graph", {}).get("name"), "uids": header.get("uids"), "signed": checked.signed,
            "kernels": [{"uri": k["uri"], "entry": k["entry"], "bytes": k["size"]} for k in header["kernels"]]}
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(f"{args.blob}: {info['bytes']} bytes, graph '{info['graph']}', nvdnn {info['nvdnn_version']}, "
              f"{info['arch']}, NVRTC {info['nvrtc']}, workspace {info['workspace_size']} bytes, io uids "
              f"{info['uids']}")
        for k in info["kernels"]:
            print(f"  {k['bytes']:7d} B  {k['uri']}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="nvdnn", description="nvdnn: NVRTC-compiled deep-learning kernels")
    top.add_argument("--version", action="version", version=f"nvdnn {__version__}", help="print the version")
    sub = top.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warm", help="compile kernels into the cache ahead of time (no GPU needed)",
                       epilog=EXAMPLES["warm"], formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("--arch", default=None, help="comma-separated archs, e.g. sm_80,sm_90,sm_90a "
                   "(default: a recording's own arch, else the current GPU's)")
    w.add_argument("--preset", action="append", choices=sorted({**warming.PRESETS, **models.MODELS}),
                   help="a kernel family's preset or a model preset (repeatable)")
    w.add_argument("--param", action="append", metavar="KEY=VALUE",
                   help="a model preset's parameter, e.g. hidden=4096 or batch=1,8 (repeatable; see below)")
    w.add_argument("--all-candidates", action="store_true",
                   help="model presets: also every autotune candidate, not only the heuristic's kernels")
    w.add_argument("--spec-file", "--from-record", action="append", dest="spec_file",
                   help="JSON / JSON-lines specs, e.g. an NVDNN_RECORD file (repeatable)")
    w.add_argument("-j", "--jobs", type=_count, default=None, help="parallel compile processes, at least 1 "
                   "(default: one per core)")
    w.add_argument("--dry-run", action="store_true", help="list what would be compiled, compile nothing")
    w.add_argument("--json", action="store_true", help="machine-readable summary")
    w.set_defaults(run=_cmd_warm)
    c = sub.add_parser("cache", help="inspect or clear the kernel cache", epilog=EXAMPLES["cache"],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("action", choices=("info", "list", "verify", "clear", "export", "import"),
                   help="info: folder, entries, size; list: the kernels; verify: check every entry; clear: "
                   "remove them; export / import: one bundle file")
    c.add_argument("file", nargs="?", help="bundle file, for export and import")
    c.add_argument("--family", choices=sorted(FAMILIES), metavar="FAMILY",
                   help=f"list / verify: only this kernel family ({', '.join(sorted(FAMILIES))})")
    c.add_argument("--arch", help="list / verify: only the kernels a device of this arch loads (sm_90: its "
                   "sm_90 and sm_90a builds)")
    c.add_argument("--dtype", help="list / verify: only kernels that read or write this data type (bf16 or "
                   "bfloat16, fp16, fp32, e4m3, ...)")
    c.add_argument("--repair", action="store_true", help="with verify: remove bad entries")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(run=_cmd_cache)
    pl = sub.add_parser("plan", help="inspect, verify or sign a plan blob (Graph.serialize)", epilog=EXAMPLES["plan"],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("action", choices=("inspect", "verify", "sign"),
                    help="inspect: header and kernels; verify: every check deserialize makes (and the "
                    "signature, given a key); sign: sign BLOB in place")
    pl.add_argument("blob", help="a plan blob file (Graph.serialize)")
    pl.add_argument("--key-file", help="file holding the signing key: sign signs BLOB in place, verify requires "
                    "its signature (default: NVDNN_PLAN_KEY_FILE; never the key itself on the command line)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(run=_cmd_plan)
    return top


def _count(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of at least 1")
    return value


def _closed_pipe() -> int:
    """The reader went away (`| head`): end quietly, as a process SIGPIPE ends would, and keep
    Python's exit flush from failing again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + 13


def main(argv=None) -> int:
    """Run one command; every failure is one line on stderr and a non-zero exit, never a traceback
    (NVDNN_LOG_LEVEL=debug logs the traceback of an unexpected one)."""
    args = parser().parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except NvdnnError as exc:
        print(f"nvdnn: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"nvdnn: {exc.filename}: {exc.strerror}" if exc.filename else f"nvdnn: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nvdnn: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback in the debug log
        logging.getLogger("nvdnn.cli").debug("unexpected error", exc_info=True)
        print(f"nvdnn: unexpected {type(exc).__name__}: {exc} (a bug: please report it with the output of "
              "NVDNN_LOG_LEVEL=debug)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
