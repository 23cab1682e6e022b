"""What Kev decides for a GPU, checked on the CPU: the attention backend for each device, dtype, KV dtype,
mode and `core.attention`, the refusals and their texts, core.precision auto, a multi-mode worker's
device and its share of KV memory, and the transformers baseline's device. The decisions are pure
functions; where an engine or a loader makes them, a real one runs here on the CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from structlog.testing import capture_logs

from engine import EngineCore, EngineOptions, load_model
from engine.kernels.backend import BackendRefused, choose_attention, log_choice, tf32_matmul
from engine.model.model import pick_dtype
from kev_async.deploy import log_gpu_settings, kv_memory_fraction, plan_workers, worker_device
from kev_async.settings import load_config
from schemas import ConfigError, config_from_dict

pytest_plugins = ["serve_fixtures"]

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def choose(device="cuda", dtype=BF16, kv="auto", deterministic=False, requested="auto", installed=True, tf32=False):
    return choose_attention(device=device, dtype=dtype, kv_dtype=kv, deterministic=deterministic,
                            requested=requested, flash_installed=installed, tf32=tf32)


# (device, dtype, kv_dtype, deterministic, requested, flash installed, tf32) -> backend, slow paths
CHOSEN = [
    # CUDA, auto: flash-attn exactly where it can run, else SDPA with the reason logged
    (("cuda", BF16, "auto", False, "auto", True, False), "flash-attn", []),
    (("cuda", FP16, "auto", False, "auto", True, False), "flash-attn", []),
    (("cuda", BF16, "auto", False, "auto", False, False), "sdpa", ["flash_attn_missing"]),
    (("cuda", FP32, "auto", False, "auto", True, False), "sdpa", ["fp32_without_tf32"]),
    (("cuda", FP32, "auto", False, "auto", True, True), "sdpa", []),
    (("cuda", FP32, "auto", False, "auto", False, False), "sdpa", ["fp32_without_tf32"]),
    (("cuda", BF16, "int8", False, "auto", True, False), "sdpa", ["int8_kv_on_cuda"]),
    (("cuda", BF16, "int8", False, "auto", False, False), "sdpa", ["int8_kv_on_cuda"]),
    (("cuda", FP32, "int8", False, "auto", True, False), "sdpa", ["int8_kv_on_cuda", "fp32_without_tf32"]),
    # CUDA, asked for
    (("cuda", BF16, "auto", False, "flash-attn", True, False), "flash-attn", []),
    (("cuda", BF16, "auto", False, "sdpa", True, False), "sdpa", []),
    (("cuda", BF16, "auto", False, "sdpa", False, False), "sdpa", []),
    (("cuda", FP32, "auto", False, "sdpa", True, False), "sdpa", ["fp32_without_tf32"]),
    (("cuda", BF16, "int8", False, "sdpa", True, False), "sdpa", ["int8_kv_on_cuda"]),
    # CPU: the CPU paths whatever the dtype and cache, flash-attn installed or not
    (("cpu", FP32, "auto", False, "auto", False, False), "sdpa", []),
    (("cpu", FP32, "auto", False, "auto", True, False), "sdpa", []),
    (("cpu", BF16, "auto", False, "auto", True, False), "sdpa", []),
    (("cpu", FP32, "int8", False, "sdpa", False, False), "sdpa", []),
    (("cpu", FP32, "auto", True, "auto", False, False), "fixed-tiles", []),
    (("cpu", BF16, "int8", True, "auto", True, False), "fixed-tiles", []),
]


def case_id(value):
    return "-".join(map(str, value)) if isinstance(value, tuple) else None


@pytest.mark.parametrize("facts,backend,slow", CHOSEN, ids=case_id)
def test_backend_choice(facts, backend, slow):
    choice = choose(*facts)
    assert choice.backend == backend
    assert [s.name for s in choice.slow_paths] == slow
    assert choice.reason


# (device, dtype, kv_dtype, deterministic, requested, flash installed) -> every text the error must hold
REFUSED = [
    (("cpu", FP32, "auto", False, "flash-attn", True), ["core.attention: flash-attn", "needs a CUDA device",
                                                        "runs on cpu", "fp16 or bf16", "core.precision"]),
    (("cuda", FP32, "auto", False, "flash-attn", True), ["fp16 or bf16 only, the model is fp32", "core.precision"]),
    (("cuda", BF16, "int8", False, "flash-attn", True), ["int8 cache", "kv_cache.dtype: int8"]),
    (("cuda", BF16, "auto", False, "flash-attn", False), ["flash-attn is not installed", "KEV_FLASH_ATTN=1"]),
    (("cuda", BF16, "auto", True, "auto", True), ["isolation.deterministic is CPU-only", "cuda",
                                                  "isolation.deterministic: false", "core.device: cpu"]),
    (("cuda", FP32, "auto", True, "sdpa", True), ["isolation.deterministic is CPU-only"]),
    (("cpu", FP32, "auto", True, "flash-attn", True), ["flash-attn cannot keep isolation.deterministic",
                                                       "core.attention: auto"]),
    (("cpu", FP32, "auto", True, "sdpa", False), ["sdpa cannot keep isolation.deterministic", "core.attention: auto"]),
    (("cpu", FP32, "auto", False, "triton", False), ["core.attention 'triton' is not one of auto, flash-attn, sdpa"]),
]


@pytest.mark.parametrize("facts,texts", REFUSED, ids=case_id)
def test_backend_refusals_say_what_is_missing(facts, texts):
    with pytest.raises(BackendRefused) as refused:
        choose(*facts)
    for text in texts:
        assert text in str(refused.value)


def test_a_flash_request_names_everything_missing_at_once():
    with pytest.raises(BackendRefused) as refused:
        choose("cpu", FP32, "int8", requested="flash-attn", installed=False)
    assert str(refused.value).count("; ") == 3  # device, dtype, cache, package


@pytest.mark.parametrize("device,dtype,kv,deterministic,requested,installed,tf32", list(itertools.product(
    ["cpu", "cuda"], [FP32, BF16, FP16], ["auto", "int8"], [False, True], ["auto", "flash-attn", "sdpa"],
    [False, True], [False, True])))
def test_every_combination_keeps_the_rules(device, dtype, kv, deterministic, requested, installed, tf32):
    """Over the whole product: flash-attn only where it runs, deterministic only as fixed tiles on the CPU,
    a refusal only for an explicit request or deterministic mode, slow paths only on CUDA."""
    try:
        choice = choose(device, dtype, kv, deterministic, requested, installed, tf32)
    except BackendRefused:
        assert deterministic or requested == "flash-attn"
        return
    if choice.backend == "flash-attn":
        assert device == "cuda" and dtype in (BF16, FP16) and kv == "auto" and installed and not deterministic
    if deterministic:
        assert device == "cpu" and choice.backend == "fixed-tiles"
    if requested == "auto" and device == "cuda" and dtype != FP32 and kv == "auto" and installed:
        assert choice.backend == "flash-attn"
    if device == "cpu":
        assert choice.slow_paths == ()


def test_the_choice_is_one_log_line_and_a_line_per_slow_path():
    choice = choose("cuda", FP32, "int8", installed=False)
    with capture_logs() as logs:
        log_choice(choice, torch.device("cuda", 0), FP32, "int8", deterministic=False)
    assert logs[0] == {"event": "attention.backend", "log_level": "info", "backend": "sdpa", "device": "cuda:0",
                       "dtype": "fp32", "kv_dtype": "int8", "mode": "fast", "reason": choice.reason}
    assert [(e["event"], e["log_level"], e["name"]) for e in logs[1:]] == [
        ("slow_path", "warning", "int8_kv_on_cuda"), ("slow_path", "warning", "fp32_without_tf32")]
    assert "flash-attn" in choice.reason and "fp16 or bf16" in choice.reason


def test_tf32_is_read_from_torch():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert tf32_matmul()
        torch.set_float32_matmul_precision("highest")
        assert not tf32_matmul()
    finally:
        torch.set_float32_matmul_precision(before)


# -- the engine and the loader make these choices --------------------------------------------------

def test_an_engine_logs_its_backend_once_at_start(tiny_model):
    with capture_logs() as logs:
        EngineCore(tiny_model, EngineOptions(num_blocks=8))
        EngineCore(tiny_model, EngineOptions(num_blocks=8, deterministic=True))
    lines = [e for e in logs if e["event"] == "attention.backend"]
    assert [(e["backend"], e["device"], e["dtype"], e["kv_dtype"], e["mode"]) for e in lines] == [
        ("sdpa", "cpu", "fp32", "auto", "fast"), ("fixed-tiles", "cpu", "fp32", "auto", "deterministic")]
    assert [e["kv_stored"] for e in lines] == ["fp32", "fp32"]  # what "auto" stores for this model
    assert not [e for e in logs if e["event"] == "slow_path"]


def test_an_engine_asked_for_flash_attn_on_cpu_refuses_at_start(tiny_model):
    with pytest.raises(BackendRefused, match="needs a CUDA device, this engine runs on cpu"):
        EngineCore(tiny_model, EngineOptions(num_blocks=8, attention="flash-attn"))


def test_kev_ask_says_why_in_one_line(tiny_model_dir, monkeypatch, capsys):
    from kev_async.cli import main

    monkeypatch.setenv("KEV_CORE__ATTENTION", "flash-attn")
    assert main(["ask", "--model", str(tiny_model_dir), "hi"]) == 2
    lines = capsys.readouterr().err.splitlines()  # the model's load logs its matmul.kernel line first
    assert lines[-1].startswith("kev ask: core.attention: flash-attn cannot run here: it needs a CUDA device")
    assert [line for line in lines if line.startswith("kev ask:")] == lines[-1:]


def test_deterministic_loading_onto_cuda_is_refused_before_any_weight_moves(tiny_model_dir):
    # No GPU needed: the refusal comes before the weights (or the CUDA runtime) are touched.
    with pytest.raises(BackendRefused, match="isolation.deterministic is CPU-only"):
        load_model(tiny_model_dir, device="cuda", deterministic=True)


def test_core_attention_is_a_config_key_the_engine_reads():
    cfg = config_from_dict({"core": {"attention": "sdpa"}})
    assert EngineOptions.from_config(cfg).attention == "sdpa"
    assert EngineOptions().attention == "auto"
    with pytest.raises(ConfigError, match="core.attention"):
        config_from_dict({"core": {"attention": "flash"}})
    assert load_config(None, env={"KEV_CORE__ATTENTION": "flash-attn"}).core.attention == "flash-attn"


# -- core.precision auto ---------------------------------------------------------------------------

def test_precision_auto_is_bf16_on_cuda_and_fp32_elsewhere():
    assert config_from_dict({}).core.precision == "auto"
    assert pick_dtype("auto", torch.device("cuda")) == BF16
    assert pick_dtype("auto", torch.device("cuda", 1)) == BF16
    assert pick_dtype("auto", torch.device("cpu")) == FP32
    assert pick_dtype("fp32", torch.device("cuda")) == FP32  # asked for: kept, and runs on sdpa
    with pytest.raises(ValueError, match="auto, fp32, bf16, fp16"):
        pick_dtype("fp8", torch.device("cpu"))


def test_the_default_precision_loads_fp32_on_cpu(tiny_model_dir):
    model = load_model(tiny_model_dir, device="cpu", dtype=config_from_dict({}).core.precision)
    assert model.dtype == FP32


# -- deploy.mode multi on GPUs ---------------------------------------------------------------------

def test_a_pinned_worker_sees_its_gpu_as_cuda():
    assert worker_device("cuda:3") == "cuda"
    assert [worker_device(d) for d in ("cuda", "auto", "cpu")] == ["cuda", "auto", "cpu"]
    cfg = config_from_dict({"deploy": {"mode": "multi", "workers": 2}, "core": {"device": "cuda:1"}})
    plans = plan_workers(cfg, ["0", "1"], [0, 1])
    assert [(p.env["CUDA_VISIBLE_DEVICES"], p.env["KEV_CORE__DEVICE"]) for p in plans] == [("0", "cuda"), ("1", "cuda")]
    # What the worker's own config loader makes of its environment.
    worker = load_config(None, env=plans[1].env)
    assert (worker.core.device, worker.deploy.mode, worker.kv_cache.memory_fraction) == ("cuda", "single", 0.5)
    with capture_logs() as logs:
        log_gpu_settings(cfg, plans)
    assert [(e["event"], e["configured"], e["used"]) for e in logs] == [("deploy.worker_device", "cuda:1", "cuda")]


def test_workers_sharing_a_gpu_split_its_kv_memory():
    assert kv_memory_fraction(0.5, 2) == 0.25
    parent_env = {"KEV_DEPLOY__MODE": "multi", "KEV_DEPLOY__WORKERS": "3", "KEV_KV_CACHE__MEMORY_FRACTION": "0.6"}
    cfg = load_config(None, env=parent_env)
    plans = plan_workers(cfg, ["0", "1"], [0, 1])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0", "1", "0"]
    # GPU 0 has two workers: each takes half of the configured share; GPU 1's worker keeps it whole.
    assert [load_config(None, env={**parent_env, **p.env}).kv_cache.memory_fraction for p in plans] == [0.3, 0.6, 0.3]
    assert all("KEV_CORE__DEVICE" not in p.env for p in plans)  # device auto: nothing to rewrite
    with capture_logs() as logs:
        log_gpu_settings(cfg, plans)
    assert [(e["event"], e["configured"], e["per_worker"]) for e in logs] == [("deploy.kv_memory_shared", 0.6, [0.3])]
    four_on_one = plan_workers(config_from_dict({"deploy": {"mode": "multi", "workers": 4}}), ["0"], [0])
    assert sum(float(p.env["KEV_KV_CACHE__MEMORY_FRACTION"]) for p in four_on_one) == pytest.approx(0.5)


def test_a_budget_in_bytes_or_blocks_is_the_operators_own_per_worker():
    for kv in ({"memory_budget_bytes": 1 << 30}, {"num_blocks": 1000}):
        cfg = config_from_dict({"deploy": {"mode": "multi", "workers": 2}, "kv_cache": kv})
        assert all("KEV_KV_CACHE__MEMORY_FRACTION" not in p.env for p in plan_workers(cfg, ["0"], [0]))


def test_cpu_workers_get_no_gpu_settings():
    cfg = config_from_dict({"deploy": {"mode": "multi", "workers": 2}, "core": {"device": "cuda:1"}})
    plans = plan_workers(cfg, [], [0, 1])
    assert all("KEV_CORE__DEVICE" not in p.env and "KEV_KV_CACHE__MEMORY_FRACTION" not in p.env for p in plans)


# -- the transformers baseline of the benchmarks ---------------------------------------------------

def test_the_transformers_baseline_runs_on_kevs_device(tiny_model):
    from kev_async.bench.model import hf_model

    with capture_logs() as logs:
        hf = hf_model(tiny_model)
    assert hf.device == tiny_model.device and hf.dtype == tiny_model.dtype
    assert [(e["event"], e["device"]) for e in logs] == [("bench.baseline_device", "cpu")]
