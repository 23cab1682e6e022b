"""ops/gpu-check.sh's facts and verdict, one command each (python3 ops/gpu_check_report.py COMMAND ...):

  machine FACTS.json            the GPU, compute capability, versions; exit 1 where torch cannot use CUDA
  model FACTS.json TINY_DIR     which model the run serves: KEV_GPU_MODEL, the built-in SmolLM2, or a tiny
                                random Llama written to TINY_DIR (Kev's venv: imports the engine)
  smoke STDOUT STDERR FACTS.json  `kev ask`'s answers and its logged attention backend; exit 1 if wrong
  summary WORK OUT SECONDS RC   summary.json and summary.txt in OUT from WORK's steps, facts and notes;
                                writes the run's exit status to WORK/exit (0 passed, 1 failed, 2 no GPU)

`machine` and `summary` run on the machine's own python with the standard library (and torch where there is
one): they must work before Kev is installed, and when its install failed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REQUIRED_STEPS = ("preflight", "install", "model", "tests", "smoke")  # compare may be not-run
DRY_RUN = os.environ.get("KEV_GPU_CHECK_DRY_RUN") == "1"  # every step on the CPU: checks the script, not CUDA
KNOWN_NOT_RUN = [
    "flash-attn: PyPI has it as source only (about an hour with nvcc); it is tested only where a wheel was "
    "installed (KEV_FLASH_ATTN=1 ops/setup.sh), else the sdpa backend alone",
    "deploy.mode multi on several GPUs: one GPU per machine here",
]


def machine(facts_path: str) -> int:
    facts = {"python": sys.version.split()[0], "python_path": sys.executable, "platform": platform.platform()}
    try:
        import torch

        facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            facts.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                         memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    except ImportError as exc:
        facts.update(torch=None, cuda_available=False, torch_error=str(exc))
    for name in ("triton", "transformers", "flash_attn", "vllm"):
        facts[name] = _version(name)
    facts["nvcc"] = _first_line(["nvcc", "--version"], last=True)
    facts["driver"] = _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    _write(facts_path, facts)
    print(json.dumps(facts, indent=1))
    return 0 if facts.get("cuda_available") else 1


def model(facts_path: str, tiny_dir: str) -> int:
    """The model the tests and `kev ask` serve; `dir` is its HF directory (what vLLM is given)."""
    from engine.model.loader import ModelNotFound, resolve_model_dir
    from schemas import DEFAULT_MODEL

    given = os.environ.get("KEV_GPU_MODEL")
    if given:
        source, kind = given, "KEV_GPU_MODEL"
    else:
        try:
            resolve_model_dir(DEFAULT_MODEL)
            source, kind = DEFAULT_MODEL, "built-in SmolLM2-135M"
        except ModelNotFound as exc:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
            from gpu_models import save_model_dir

            source = str(save_model_dir(tiny_dir))
            kind = f"tiny random Llama stand-in ({exc}; its GGUF is 98 MB, over what a run may carry)"
    facts = {"source": source, "kind": kind, "dir": str(resolve_model_dir(source))}
    _write(facts_path, facts)
    print(json.dumps(facts, indent=1))
    return 0


def smoke(stdout_path: str, stderr_path: str, facts_path: str) -> int:
    """`kev ask` answered every question, and said once which attention runs where, in what precision."""
    out, err = Path(stdout_path).read_text(), Path(stderr_path).read_text()
    events = [_json(line) for line in err.splitlines()]
    events = [e for e in events if e]
    backends = [e for e in events if e.get("event") == "attention.backend"]
    facts = {"attention_backend": backends[0] if backends else None,
             "slow_paths": [e.get("name") for e in events if e.get("event") == "slow_path"],
             "answers_line": (out.strip().splitlines() or [""])[-1], "errors": out.count("\nerror ")}
    problems = []
    if len(backends) != 1:
        problems.append(f"expected one attention.backend log line, found {len(backends)}")
    else:
        line = backends[0]
        flash = _version("flash_attn") is not None
        # the defaults on CUDA: bf16, flash-attn where installed; a dry run: the CPU's fp32 and SDPA
        device, expected = ("cpu", ("sdpa", "fp32")) if DRY_RUN else ("cuda", ("flash-attn" if flash else "sdpa", "bf16"))
        if not str(line.get("device", "")).startswith(device):
            problems.append(f"the engine ran on {line.get('device')}, not {device}")
        if (line.get("backend"), line.get("dtype")) != expected:
            problems.append(f"backend {line.get('backend')} in {line.get('dtype')}, expected {expected[0]} in "
                            f"{expected[1]} (flash-attn {'installed' if flash else 'not installed'})")
    if not facts["answers_line"].startswith("3 answers") or facts["errors"]:
        problems.append(f"not 3 answers without error: {facts['answers_line']!r}, {facts['errors']} errors")
    facts["problems"] = problems
    _write(facts_path, facts)
    print(json.dumps(facts, indent=1))
    return 1 if problems else 0


def summary(work: str, out: str, seconds: str, rc: str) -> int:
    work_dir, out_dir = Path(work), Path(out)
    steps = _steps(work_dir)
    facts = {p.stem: json.loads(p.read_text()) for p in sorted((work_dir / "facts").glob("*.json"))}
    states = {s["name"]: s["state"] for s in steps}
    if states.get("preflight") != "passed":
        verdict, code = "no GPU", 2
    elif all(states.get(name) == "passed" for name in REQUIRED_STEPS) and states.get("compare") != "failed":
        verdict, code = "passed", 0
    else:
        verdict, code = "failed", 1
    if DRY_RUN:
        verdict = f"dry run on the CPU (no GPU checked): {verdict}"
    result = {"verdict": verdict, "exit": code, "seconds": int(seconds), "script_status": int(rc),
              "machine": facts.get("machine"), "model": facts.get("model"), "steps": steps,
              "tests": _junit(work_dir / "logs" / "junit.xml"), "smoke": facts.get("smoke"),
              "compare": _compare(work_dir / "logs" / "load.json"), "known_not_run": KNOWN_NOT_RUN}
    (out_dir / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    text = _text(result)
    (out_dir / "summary.txt").write_text(text)
    print(text, end="")
    (work_dir / "exit").write_text(f"{code}\n")
    return 0


def _steps(work: Path) -> list[dict]:
    steps = []
    table = work / "steps.tsv"
    for row in (table.read_text().splitlines() if table.exists() else []):
        name, state, secs, status = (row.split("\t") + ["-"])[:4]
        note_file = work / "notes" / name
        note = note_file.read_text().strip() if note_file.exists() else ""
        if state == "failed" and not note:
            note = _last_line(work / "logs" / f"{name}.log")
        if status in ("124", "137"):
            note = f"timed out. {note}".strip()
        steps.append({"name": name, "state": state, "seconds": int(secs), "status": status, "note": note})
    return steps


def _last_line(path: Path) -> str:
    lines = [line for line in (path.read_text(errors="replace").splitlines() if path.exists() else []) if line.strip()]
    return lines[-1][:300] if lines else ""


def _junit(path: Path) -> dict | None:
    """Counts from pytest's JUnit XML (a skip is counted: tests/gpu/conftest.py already made it a failure),
    the failures' names and first message lines, and the properties the tests recorded."""
    if not path.exists():
        return None
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('name')}: {((problem.get('message') or '').splitlines() or [''])[0][:300]}"
              for case in suite.iter("testcase") for problem in [*case.findall("failure"), *case.findall("error")]]
    properties = {prop.get("name"): prop.get("value") for prop in suite.iter("property")}
    return {**counts, "failed": failed, "recorded": properties}


def _compare(path: Path) -> dict | None:
    if not path.exists():
        return None
    points = json.loads(path.read_text()).get("points", [])
    keep = ("system", "questions", "completed", "goodput_tps", "ttft_p50_s", "e2e_p50_s", "e2e_p99_s", "identical")
    systems = [{k: p.get(k) for k in keep} for p in points]
    kev = next((s for s in systems if s["system"].startswith("kev")), None)
    other = next((s for s in systems if not s["system"].startswith("kev")), None)
    ratio = kev["goodput_tps"] / other["goodput_tps"] if kev and other and other["goodput_tps"] else None
    return {"systems": systems, "kev_over_vllm_goodput": ratio}


def _text(result: dict) -> str:
    m = result.get("machine") or {}
    lines = [f"gpu-check: {result['verdict']} in {result['seconds']} s (exit {result['exit']})",
             f"machine: {m.get('gpu', '?')} (compute {m.get('capability', '?')}, {m.get('memory_gib', '?')} GiB), "
             f"python {m.get('python', '?')}, torch {m.get('torch', '?')} (CUDA {m.get('torch_cuda', '?')}), "
             f"triton {m.get('triton')}, transformers {m.get('transformers')}, flash-attn {m.get('flash_attn')}"]
    if result.get("model"):
        lines.append(f"model: {result['model']['source']} ({result['model']['kind']})")
    lines += [f"  {s['name']:<10} {s['state']:<8} {s['seconds']:>4} s  {s['note']}" for s in result["steps"]]
    tests = result.get("tests")
    if tests:
        lines.append(f"tests/gpu: {tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
                     f"{tests['skipped']} skipped")
        lines += [f"  FAILED {f}" for f in tests["failed"]]
    smoke_facts = result.get("smoke") or {}
    if smoke_facts.get("attention_backend"):
        line = smoke_facts["attention_backend"]
        lines.append(f"kev ask: attention {line.get('backend')} on {line.get('device')} in {line.get('dtype')}, "
                     f"slow paths {smoke_facts.get('slow_paths') or 'none'}; {smoke_facts.get('answers_line')}")
    compare = result.get("compare")
    if compare and compare.get("kev_over_vllm_goodput"):
        lines.append(f"kev vs vLLM goodput: {compare['kev_over_vllm_goodput']:.2f}x")
    lines += [f"not run here: {item}" for item in result["known_not_run"]]
    return "\n".join(lines) + "\n"


def _version(module: str) -> str | None:
    from importlib import metadata, util

    if util.find_spec(module) is None:
        return None
    names = {"flash_attn": "flash-attn"}
    try:
        return metadata.version(names.get(module, module))
    except metadata.PackageNotFoundError:
        return "present"


def _first_line(command: list[str], last: bool = False) -> str | None:
    try:
        lines = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (lines[-1] if last else lines[0]) if lines else None


def _json(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _write(path: str, value: dict) -> None:
    Path(path).write_text(json.dumps(value, indent=1) + "\n")


COMMANDS = {"machine": machine, "model": model, "smoke": smoke, "summary": summary}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    sys.exit(COMMANDS[sys.argv[1]](*sys.argv[2:]))
