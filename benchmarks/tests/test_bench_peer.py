"""`kev bench peer`: Kev's side measured for real on the tiny model and on a tiny GGUF in block formats, and
the errors a user meets when the URL is not a llama-server or serves another model. The llama.cpp side
itself is measured in docs/speed.md; here a small HTTP server stands where llama-server would, answering
its /props, /tokenize and /completion shapes (or not), and its memory is this process's own."""

import json
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gguf_writer import write_llama_gguf
from kev_async.bench.llama_server import LlamaServer
from kev_async.bench.peer import KevSide, bench_peer, decode_prompt, prefill_prompts
from kev_async.cli import main

pytest_plugins = ["serve_fixtures"]

GGUF_FORMATS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
                "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q8_0", "token_embd": "Q4_K"}

LLAMA_TIMINGS = {"cache_n": 0, "prompt_ms": 100.0, "prompt_per_token_ms": 2.0, "prompt_per_second": 500.0,
                 "predicted_ms": 60.0, "predicted_per_token_ms": 4.0, "predicted_per_second": 250.0}


def test_kev_side_times_every_token_of_one_answer_and_one_prompt(tiny_model):
    prompt = decode_prompt(tiny_model)
    kev = KevSide(tiny_model, max_tokens=len(prompt) + 200)
    ms, tokens = kev.decode(prompt, 24)
    assert len(tokens) == 24  # EOS ignored: the whole budget, as llama-server's ignore_eos
    assert 0 < ms < 1000
    assert kev.decode(prompt, 24)[1] == tokens  # greedy, alone: the same answer every repeat
    prompts = prefill_prompts(tiny_model, 150, 3)
    assert [len(p) for p in prompts] == [150, 150, 150] and len({tuple(p) for p in prompts}) == 3
    assert all(kev.prefill(p) > 0 for p in prompts)
    assert not kev.core.has_work


def test_unreachable_url_is_one_clear_line(tiny_model_dir, capsys):
    assert _peer(tiny_model_dir, "http://127.0.0.1:9") == 2
    err = capsys.readouterr().err
    assert err.startswith("kev bench peer: error: cannot reach http://127.0.0.1:9/props")
    assert "llama-server -m" in err
    assert _peer(tiny_model_dir, "localhost:8081") == 2
    assert "give an http:// or https:// URL" in capsys.readouterr().err


def test_a_server_without_timings_is_not_llama_server(tiny_model_dir, capsys):
    with _server(lambda body: {"choices": [{"text": "hi"}]}) as url:  # an OpenAI-style answer
        assert _peer(tiny_model_dir, url) == 2
    assert "without llama-server's `timings`" in capsys.readouterr().err


def test_the_table_puts_kev_beside_the_servers_timings(tiny_model, tiny_model_dir):
    lines = []
    with _server(_llama, _tokenizer(tiny_model_dir)) as url:
        result = bench_peer(tiny_model, LlamaServer(url), repeats=3, new_tokens=12, prompt_tokens=120,
                            out=lines.append)
    out = "\n".join(lines)
    assert any(line.startswith("machine: ") and "(" in line for line in lines)  # the CPU and its flags
    assert result["llama decode"] == 4.0 and result["llama prefill"] == 500.0  # llama.cpp's timings, as sent
    assert result["kev decode"] == statistics.median(result["runs"]["kev decode"]) > 0
    assert result["kev prefill"] == statistics.median(result["runs"]["kev prefill"]) > 0
    # The table prints the unrounded figures, each rounded once: ms as llama / kev, tokens/s as kev / llama.
    decode, prefill = result["kev decode"], result["kev prefill"]
    assert f"| decode, one question (ms/token) | {decode:.2f} | 4.00 | {4.0 / decode:.2f}x | 3 |" in lines
    assert f"| prefill, 120-token prompt (tokens/s) | {prefill:.0f} | 500 | {prefill / 500.0:.2f}x | 3 |" in lines
    assert len(result["runs"]["kev decode"]) == 3
    paired = ", ".join(f"{4.0 / ms:.2f}" for ms in result["runs"]["kev decode"])
    assert f"  kev speed / llama.cpp within each repeat: decode {paired} (median " in out
    assert "greedy tokens, kev vs llama.cpp: " in out and "/12); every repeat the same answer on each side: yes" in out
    weights = tiny_model.weights.nbytes / 2**20
    assert f"  kev now: weights {weights:,.0f}, KV pool " in out and "(float32), the rest " in out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, harness, smollm2_tokenizer):
    hf = harness.build_hf_tiny("llama", seed=3, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, vocab_size=1024, num_hidden_layers=2)
    return write_llama_gguf(hf, tmp_path_factory.mktemp("peer") / "tiny-q4km.gguf", GGUF_FORMATS, smollm2_tokenizer)


def test_a_gguf_file_runs_as_stored_beside_the_server_on_the_same_file(tiny_gguf, capsys):
    props = {"model_path": str(tiny_gguf), "total_slots": 1, "default_generation_settings": {"n_ctx": 512}}
    with _server(_llama, _tokenizer(tiny_gguf), props) as url:
        assert _peer(tiny_gguf, url, "--repeats", "1", "--new-tokens", "6", "--prompt-tokens", "64") == 0
    out = capsys.readouterr().out
    assert "(gguf weights, torch.float32 compute)" in out and "KV pool 512 tokens" in out  # the server's n_ctx
    assert f"llama.cpp: {tiny_gguf}, build ?, 1 slot(s), context 512" in out
    assert "prompt token ids: llama-server's /tokenize makes Kev's ids of the same text (the chat prompt " in out
    # The stand-in listens in this very process: found by its port, its memory is Kev's own.
    memory = _after(out, "resident memory MiB (VmHWM peak, VmRSS now): ")
    assert "not readable" not in memory and memory.endswith("peak 1.00x, now 1.00x")


def test_a_server_on_another_model_is_refused_before_measuring(tiny_gguf, capsys):
    tokenizer = _tokenizer(tiny_gguf)
    with _server(_llama, lambda text: [t + 1 for t in tokenizer(text)]) as url:
        assert _peer(tiny_gguf, url, "--repeats", "1", "--new-tokens", "4", "--prompt-tokens", "32") == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kev bench peer: error: llama-server tokenizes the chat prompt otherwise than Kev's")
    assert "start it on the same model as --model" in captured.err and "| decode" not in captured.out


def _llama(body):
    timings = {**LLAMA_TIMINGS, "prompt_n": len(body["prompt"]), "predicted_n": body["n_predict"]}
    return {"content": "", "tokens": [7] * body["n_predict"], "timings": timings}


def _tokenizer(model):
    """What llama-server's /tokenize does with the same tokenizer: text to ids, special tokens parsed."""
    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(str(model), weights=False))
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _peer(model_dir, url: str, *extra: str) -> int:
    return main(["bench", "peer", "--url", url, "--model", str(model_dir), "--threads", "2", *extra])


def _after(out: str, marker: str) -> str:
    return next(line for line in out.splitlines() if marker in line).split(marker, 1)[1]


class _server:
    """A real HTTP server on a free port: `props` (else 404) on GET /props, {"tokens": tokenize(content)} on
    POST /tokenize (404 without `tokenize`), `answer(body)` as JSON on POST /completion and anything else."""

    def __init__(self, answer, tokenize=None, props=None):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._send(200, props) if props else self._send(404, {"error": "not here"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    self._send(200, {"tokens": tokenize(body["content"])}) if tokenize else self._send(404, {})
                else:
                    self._send(200, answer(body))

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    def __enter__(self) -> str:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
