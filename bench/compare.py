"""Our PPO step side by side with TRL's on the identical config, prompts, stand-in scorer and machine.

``python -m bench.compare --config bench-cpu [--iters 5] [--precision auto|fp32] [--peers trl011-per-query,...]``

Each peer runs in its own virtual environment under ``bench/.venvs/`` (created on first use, reused after; TRL is
never a dependency of the product). Ours and each peer run in turn as subprocesses of this one invocation; each prints
one JSON line (see ``bench.configs.summarize``), and this script prints the table, every peer's s/iter and peak memory
as multiples of ours, and, as its last line, one JSON object with everything. The peer ``ours-lora16`` is our own
trainer with LoRA r = 16 (in this interpreter): ``--config bench-cpu-medium --peers ours-lora16`` sets LoRA against
full fine-tuning on a GPT-2-medium shape; ``ours-compiled`` and ``ours-eager`` are ours with ppo.compile true and
false (``--peers ours-compiled,ours-eager,trl011-batched`` sets both against TRL in one run).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import site
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

from bench.configs import add_common_args

ROOT = Path(__file__).resolve().parents[1]
VENVS = ROOT / "bench" / ".venvs"
TORCH = "torch==2.13.0"  # the CPU wheel; an unpinned torch pulls a multi-GB CUDA build
# docs/gpu.md's glibc setting (freed memory kept for reuse), given to ours and every peer alike, unless set already
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "1073741824"}

# peer venv -> what it installs on top of torch (versions pinned: a benchmark of "TRL" must say which TRL)
REQUIREMENTS = {
    # TRL 0.11 imports rich without declaring it; transformers 4.46 is the release line it was tested with
    "trl011": ["trl==0.11.4", "transformers==4.46.3", "rich"],
    # the last release that still ships PPO (trl.experimental.ppo)
    "trl112": ["trl==1.12.0"],
}


@dataclass(frozen=True)
class Peer:
    venv: str | None  # None: this interpreter (our trainer in another setting)
    module: str
    args: tuple[str, ...] = ()


PEERS = {
    "trl011-per-query": Peer("trl011", "bench.peers.trl_legacy", ("--generate", "per-query")),
    "trl011-batched": Peer("trl011", "bench.peers.trl_legacy", ("--generate", "batched")),
    "trl112": Peer("trl112", "bench.peers.trl_experimental"),
    "ours-lora16": Peer(None, "bench.ppo_step", ("--lora-r", "16")),
    # ours with the update's step compiled, and eager (ppo.compile true / false; "ours" runs the default, auto)
    "ours-compiled": Peer(None, "bench.ppo_step", ("--compile", "true")),
    "ours-eager": Peer(None, "bench.ppo_step", ("--compile", "false")),
}


def bench_env(peer: bool = True) -> dict[str, str]:
    """The environment of a benchmark run; a peer's (and its pip's) has no PYTHONPATH, which would put this
    interpreter's packages ahead of the venv's own."""
    env = {k: v for k, v in os.environ.items() if not (peer and k == "PYTHONPATH")}
    return ALLOCATOR | env | {
        "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1"}


def pip(python: Path, *args: str, wheels: Path | None) -> None:
    offline = ("--no-index", "--find-links", str(wheels)) if wheels is not None else ()
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *offline, *args], check=True, env=bench_env())


def setup_venv(name: str, wheels: Path | None = None, system_torch: bool = False) -> Path:
    """Create (or reuse) the peer's venv: torch first, then the peer's packages with torch held at its pin.

    ``system_torch`` (a GPU machine, whose CUDA torch is not on PyPI's CPU pin): the venv sees this interpreter's
    packages after its own (a .pth file), so it uses that torch and installs only what the peer needs on top.
    A marker file records what was installed, so a changed pin reinstalls and an unchanged one is free.
    """
    folder = VENVS / (name + ("-system-torch" if system_torch else ""))
    python = folder / "bin" / "python"
    torch_pin = f"torch=={importlib.metadata.version('torch')}" if system_torch else TORCH
    wanted = "\n".join([torch_pin, *REQUIREMENTS[name]]) + "\n"
    marker = folder / "bench-requirements.txt"
    if marker.exists() and marker.read_text() == wanted and python.exists():
        return python
    print(f"setting up {folder} ({' '.join(REQUIREMENTS[name])})", flush=True)
    venv.create(folder, with_pip=True, clear=True)
    if system_torch:
        parent = [*site.getsitepackages(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        site_packages = next(folder.glob("lib/python*/site-packages"))
        (site_packages / "zz_parent_packages.pth").write_text("\n".join(parent) + "\n")
    else:
        pip(python, TORCH, wheels=wheels)
    constraints = folder / "constraints.txt"
    constraints.write_text(torch_pin + "\n")
    pip(python, "-c", str(constraints), *REQUIREMENTS[name], wheels=wheels)
    version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], check=True,
                             capture_output=True, text=True, env=bench_env()).stdout.strip()
    if not version.startswith(torch_pin.split("==")[1]):
        raise SystemExit(f"error: {folder}: torch {version} was installed instead of {torch_pin}")
    marker.write_text(wanted)
    return python


def run(runner: str, command: list[str], env: dict[str, str]) -> dict | None:
    """Run one benchmark script, echoing its output; its result is the JSON object on its last line."""
    print(f"\n=== {runner}: {' '.join(command[1:])}", flush=True)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    for line in proc.stdout:
        print(f"[{runner}] {line}", end="", flush=True)
        last = line.strip() or last
    if proc.wait() != 0:
        print(f"error: {runner} failed (exit code {proc.returncode}); see its output above", flush=True)
        return None
    return json.loads(last)


def print_table(results: dict[str, dict], peak: float) -> dict[str, dict[str, float]]:
    """The side-by-side table; returns each runner's s/iter and peak memory as multiples of ours."""
    ours = results.get("ours")
    ratios = {name: {key: r[key] / ours[key] for key in ("s_per_iter", "peak_mem_mb")}
              for name, r in results.items()} if ours else {}
    header = f"{'runner':<18}{'generate':>9}{'score':>7}{'forward':>8}{'update':>8}{'s/iter':>8}{'samples/s':>10}"
    print(f"\n{header}{'update GFLOP/s':>15}{'% of peak':>10}{'s/iter / ours':>14}{'peak MB':>9}{'/ ours':>7}"
          "  precision")
    for name, r in results.items():
        time, memory = (f"{ratios[name][key]:.2f}x" if name in ratios else "-" for key in ("s_per_iter",
                                                                                          "peak_mem_mb"))
        print(f"{name:<18}{r['generate_s']:>9.2f}{r['score_s']:>7.2f}{r['forward_s']:>8.2f}{r['update_s']:>8.2f}"
              f"{r['s_per_iter']:>8.2f}{r['samples_per_s']:>10.2f}{r['update_gflops']:>15.1f}"
              f"{r['update_gflops'] / peak:>10.0%}{time:>14}{r['peak_mem_mb']:>9.0f}{memory:>7}  "
              f"{r.get('precision', '-')}")
    print(f"seconds are medians per iteration; peak = {peak:.0f} GFLOP/s matmul on this machine; update FLOPs = "
          "ppo_epochs x batch x 6 x (bodies x 12 L E^2 x padded length + E V x LM-head positions)")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from: {', '.join(PEERS)}")
    parser.add_argument("--setup-only", action="store_true", help="create/update the peer venvs and stop")
    parser.add_argument("--wheels", type=Path, help="install the peer venvs offline from this folder of wheels")
    parser.add_argument("--system-torch", action="store_true",
                        help="build the peer venvs on this interpreter's torch (a CUDA machine), not the CPU pin")
    parser.add_argument("--peak-gflops", type=float, help="the yardstick for the update (default: measured by ours)")
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"error: --peers: unknown peer {unknown[0]!r} (known: {', '.join(PEERS)})")
    venvs = dict.fromkeys(PEERS[p].venv for p in peers if PEERS[p].venv is not None)
    pythons = {name: setup_venv(name, args.wheels, args.system_torch) for name in venvs}
    if args.setup_only:
        return

    tokenizer = str(Path(args.tokenizer).resolve()) if Path(args.tokenizer).exists() else args.tokenizer
    common = ["--config", args.config, "--data", str(args.data.resolve()), "--tokenizer", tokenizer,
              "--iters", str(args.iters), "--precision", args.precision] + (["--threads", str(args.threads)]
                                                                            if args.threads else [])
    commands = {"ours": [sys.executable, "-m", "bench.ppo_step"]}
    commands |= {p: [str(pythons[PEERS[p].venv]) if PEERS[p].venv else sys.executable, "-m", PEERS[p].module,
                     *PEERS[p].args] for p in peers}
    results = {}
    for runner, command in commands.items():
        result = run(runner, command + common, bench_env(peer=command[0] != sys.executable))
        if result is not None:
            results[runner] = result
    if not results:
        raise SystemExit("error: every benchmark run failed")

    peak = args.peak_gflops or results.get("ours", next(iter(results.values())))["peak_gflops"]
    ratios = print_table(results, peak)
    same_prompts = len({r["prompts_sha1"] for r in results.values()}) == 1
    if not same_prompts:
        print("warning: the runners saw different prompts (prompts_sha1 differs): the comparison is not like for like")
    failed = [runner for runner in commands if runner not in results]
    print(json.dumps({"config": args.config, "iters": args.iters, "peak_gflops": peak, "same_prompts": same_prompts,
                      "failed": failed, "ratio_to_ours": {k: round(v["s_per_iter"], 3) for k, v in ratios.items()},
                      "memory_ratio_to_ours": {k: round(v["peak_mem_mb"], 3) for k, v in ratios.items()},
                      "results": results}))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
