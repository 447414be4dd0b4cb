"""The torch-npu2 command: info, and generate on a local HF checkpoint directory."""
import os
import signal

import pytest

from torch_npu2 import cli


def test_info_reports_backend_toolchain_and_cache(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(__import__("sys").modules, "pyxrt", None)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend that would be used: emulator" in out
    assert "pyxrt:  missing" in out and "NPU toolchain" in out
    assert f"artifact cache: {tmp_path}" in out and "transformers" in out


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_generate_one_shot_on_a_checkpoint_directory(tmp_path, capsys, monkeypatch, smollm2_loaded):
    from tests.patch_llama.tiny import tiny_llama

    _, tokenizer = smollm2_loaded
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "Hello", "--max-new-tokens", "6",
                     "--backend", "emulator"]) == 0
    err = capsys.readouterr().err
    assert "running on: emulated NPU2" in err and "decode: 6 tokens, " in err


@pytest.fixture
def no_model_load(monkeypatch):
    """Argument errors must come before the model load: loading fails the test."""
    from torch_npu2.patch_llama import models

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", load_model)


def _usage_error(capsys, argv) -> str:
    """The argparse-style error line of ``argv`` (exit code 2, no traceback)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "argument --temperature: expected a number >= 0 (0 = greedy), got -1.0"),
    (["--temperature", "nan"], "argument --temperature: expected a number >= 0 (0 = greedy), got nan"),
    (["--top-p", "2"], "argument --top-p: expected a number in (0, 1], got 2.0"),
    (["--top-p", "0"], "argument --top-p: expected a number in (0, 1], got 0.0"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an int >= 1, got 0"),
    (["--top-k", "-3"], "argument --top-k: expected an int >= 0 (0 = off), got -3"),
    (["--repetition-penalty", "0"], "argument --repetition-penalty: expected a number > 0 (1 = off), got 0.0"),
    (["--stop", ""], "argument --stop: expected non-empty strings, got ('',)"),
    (["--json"], "argument --json: needs a prompt (--prompt or --prompt-file); the chat is interactive"),
])
def test_generate_rejects_bad_sampling_before_loading(capsys, no_model_load, argv, message):
    assert _usage_error(capsys, ["generate", *argv]) == f"torch-npu2 generate: error: {message}"


def test_generate_rejects_a_missing_model_before_loading(tmp_path, capsys, no_model_load):
    line = _usage_error(capsys, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])
    assert line.endswith(f"argument --model: {tmp_path / 'nope'} does not exist (expected a HF checkpoint "
                         "directory or a .gguf file)")
    (tmp_path / "empty").mkdir()
    assert "is a directory without config.json" in _usage_error(
        capsys, ["generate", "--model", str(tmp_path / "empty"), "--prompt", "x"])
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "is neither a HF checkpoint directory nor a .gguf file" in _usage_error(
        capsys, ["serve", "--model", str(tmp_path / "weights.bin")])


def test_prompt_file_errors_name_the_file(tmp_path, capsys, no_model_load):
    line = _usage_error(capsys, ["generate", "--prompt-file", str(tmp_path / "missing.txt")])
    assert line.startswith("torch-npu2 generate: error: argument --prompt-file: cannot read") and "missing.txt" in line
    (tmp_path / "blank.txt").write_text("  \n")
    assert _usage_error(capsys, ["generate", "--prompt-file", str(tmp_path / "blank.txt")]).endswith(
        f"argument --prompt-file: the prompt read from {tmp_path / 'blank.txt'} is empty")
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "a", "--prompt-file", "b"])


def test_a_bogus_backend_variable_is_refused_up_front(capsys, monkeypatch, no_model_load):
    monkeypatch.setenv("TORCH_NPU2_BACKEND", "gpu")
    expected = "error: TORCH_NPU2_BACKEND='gpu': expected one of auto, npu2, emulator"
    assert _usage_error(capsys, ["generate", "--prompt", "x"]) == f"torch-npu2 generate: {expected}"
    assert _usage_error(capsys, ["info"]) == f"torch-npu2 info: {expected}"


def test_an_unavailable_npu_backend_fails_before_loading_and_info_says_so(capsys, monkeypatch, no_model_load):
    monkeypatch.setitem(__import__("sys").modules, "pyxrt", None)
    line = _usage_error(capsys, ["generate", "--backend", "npu2", "--prompt", "x"])
    assert "the npu2 backend was requested but cannot run here: pyxrt: cannot be imported" in line
    monkeypatch.setenv("TORCH_NPU2_BACKEND", "npu2")
    assert "cannot run here" in _usage_error(capsys, ["generate", "--prompt", "x"])
    assert cli.main(["info"]) == 1
    assert "backend that would be used: unavailable: the npu2 backend was requested" in capsys.readouterr().out
    monkeypatch.delenv("TORCH_NPU2_BACKEND")
    assert cli.main(["info", "--backend", "emulator"]) == 0


def test_compile_buckets_are_checked_against_the_builders(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=1, vocab_size=256).save_pretrained(tmp_path / "config")
    model = ["--model", str(tmp_path / "config")]
    assert _usage_error(capsys, ["compile", "--buckets", "0"]).endswith(
        "argument --buckets: expected a positive int, got 0")
    line = _usage_error(capsys, ["compile", *model, "--emit-mlir", str(tmp_path / "out"), "--buckets", "16", "17"])
    assert line.endswith("argument --buckets: the model's prefill Programs at 17 cannot be built for NPU2 "
                         "(rms_gemms_rope_w8x2: gemm_int launch: M=17: must be a multiple of 16)")
    assert not (tmp_path / "out").exists()  # refused before anything was written
    assert "at 24 cannot be built" in _usage_error(capsys, ["lint", *model, "--buckets", "24"])
    assert cli.main(["compile", *model, "--emit-mlir", str(tmp_path / "out"), "--buckets", "32"]) == 0


def test_unknown_backend_is_refused(capsys):
    line = _usage_error(capsys, ["generate", "--backend", "gpu"])
    assert line.endswith("argument --backend: invalid choice: 'gpu' (choose from 'auto', 'npu2', 'emulator')")


def test_compile_emit_mlir_needs_no_toolchain(tmp_path, capsys, smollm2_loaded):
    assert cli.main(["compile", "--emit-mlir", str(tmp_path), "--buckets", "16", "64"]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.mlir"))  # the default "auto" precision: integer GEMMs
    assert names == ["flash_attn_16.mlir", "flash_attn_64.mlir", "lm_head_gemv_packed.mlir", "o_ffn_w8x2_16.mlir",
                     "o_ffn_w8x2_64.mlir", "o_gemv_ffn.mlir", "o_gemv_ffn_rms_gemv_rope.mlir",
                     "rms_gemms_rope_w8x2_16.mlir", "rms_gemms_rope_w8x2_64.mlir", "rms_gemv_rope.mlir"]
    assert "func.func @o_ffn_w8x2(" in (tmp_path / "o_ffn_w8x2_64.mlir").read_text()
    assert "wrote 10 modules" in capsys.readouterr().out


def test_matmul_precision_option_reaches_the_programs(tmp_path, monkeypatch, smollm2_loaded):
    import torch_npu2.kernels

    made = []
    real = torch_npu2.kernels.programs_for_model
    monkeypatch.setattr(torch_npu2.kernels, "programs_for_model",
                        lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    assert cli.main(["compile", "--emit-mlir", str(tmp_path), "--buckets", "16", "--matmul-precision", "bfp16"]) == 0
    assert {l.p["precision"] for p in made[0] for l in p.launches if l.kind == "gemm"} == {"bfp16"}
    args = cli.build_parser().parse_args(["generate", "--matmul-precision", "bfp16"])
    assert args.matmul_precision == "bfp16"
    assert cli.build_parser().parse_args(["compile"]).matmul_precision == "auto"
    with pytest.raises(SystemExit):
        cli.main(["compile", "--matmul-precision", "fp8"])


def test_compile_without_toolchain_lists_what_is_missing(capsys, monkeypatch, smollm2_loaded):
    from torch_npu2.kernels import compile as pipeline

    monkeypatch.setattr(pipeline, "missing_toolchain", lambda: ["aircc (mlir-air): not on PATH", "Peano: unset"])
    assert cli.main(["compile"]) == 2
    err = capsys.readouterr().err
    assert "the NPU toolchain is incomplete" in err and "aircc (mlir-air)" in err and "Peano: unset" in err


def test_compile_to_npu_instructions_prints_a_table_and_names_failures(air_tools, capsys, monkeypatch, smollm2_loaded):
    """The real AIR passes on one decode Program, plus one that cannot lower (a GEMM without broadcasts)."""
    import torch_npu2.kernels
    from torch_npu2.kernels import catalog
    from torch_npu2.kernels.program import Arg, CompileOptions, Launch, Program, Role

    broken = Program("gemm_probe", (Arg("a", (64, 576), "bf16", Role.INPUT), Arg("w", (192, 576), "bf16", Role.INPUT),
                                    Arg("c", (64, 192), "bf16", Role.OUTPUT)),
                     (Launch("gemm", (("K", 576), ("M", 64), ("N", 192)), ("a", "w"), ("c",)),),
                     compile_options=CompileOptions(omit_auto_broadcast=True))
    decode = catalog.rms_gemv_rope_program(576, 9, 3, 64, 1e-5)
    monkeypatch.setattr(torch_npu2.kernels, "programs_for_model", lambda dims, buckets, precision, **k: [decode, broken])
    assert cli.main(["compile", "--target", "npu-insts"]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split()[:3] == ["program", "result", "segments"]
    row = lines[1].split()
    assert row[:3] == ["rms_gemv_rope", "pass", "3"] and int(row[3]) == 8  # three launches, the GEMVs on 8 tiles
    assert lines[2].split()[:5] == ["gemm_probe", "FAIL", "at", "air-to-aie", "(air-to-aie)"]
    assert lines[3] == "1 of 2 Programs lowered to NPU instructions"
    assert "gemm_probe: air-to-aie (air-to-aie): <unknown>:0: error: 'aie.memtile_dma' op has more than 48 blocks" \
        in captured.err
    assert "AIR: mlir-air 0e3df89d" in captured.err


def test_compile_to_npu_instructions_without_the_air_tools_says_how_to_get_them(capsys, monkeypatch, smollm2_loaded):
    from torch_npu2.kernels import toolchain

    monkeypatch.setenv(toolchain.AIR_TOOLS_VARIABLE, "/nonexistent")
    assert cli.main(["compile", "--target", "npu-insts"]) == 2
    err = capsys.readouterr().err
    assert "cannot lower to NPU instructions" in err and "TORCH_NPU2_AIR_TOOLS=/nonexistent holds neither" in err


@pytest.fixture
def tiny_cli(tiny_checkpoint, tmp_path, monkeypatch):
    """The generate arguments for the tiny checkpoint on the emulator, with a private artifact cache."""
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path / "cache"))
    return ["generate", "--model", str(tiny_checkpoint), "--backend", "emulator"]


def _reference_answer(tiny_checkpoint, messages, max_new_tokens):
    """The unpatched model's greedy answer, for comparison."""
    from torch_npu2.patch_llama.models import load_model
    from torch_npu2.textgen import chat_input_ids

    model, tokenizer = load_model(tiny_checkpoint)
    ids = chat_input_ids(tokenizer, messages)
    out = model.generate(input_ids=ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_generate_json_with_a_system_message_from_a_prompt_file(tiny_cli, tiny_checkpoint, tmp_path, capsys):
    import json

    (tmp_path / "prompt.txt").write_text("Hello")
    assert cli.main([*tiny_cli, "--prompt-file", str(tmp_path / "prompt.txt"), "--system", "Be brief.",
                     "--max-new-tokens", "5", "--json"]) == 0
    captured = capsys.readouterr()
    answer = json.loads(captured.out)
    expected = _reference_answer(tiny_checkpoint, [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hello"}], 5)
    assert answer["text"] == expected and answer["completion_tokens"] == 5 and answer["finish_reason"] == "length"
    assert answer["time_to_first_token_s"] > 0 and answer["decode_tokens_per_s"] > 0
    assert answer["model"] == tiny_checkpoint.name
    assert "[prefill: " in captured.err and "first token after" in captured.err and "decode: 5 tokens" in captured.err


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_generate_reads_the_prompt_from_stdin_without_streaming(tiny_cli, tiny_checkpoint, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello"))
    printed = []
    monkeypatch.setattr(cli, "_print_now", printed.append)
    assert cli.main([*tiny_cli, "--prompt", "-", "--max-new-tokens", "4", "--no-stream"]) == 0
    assert not printed  # nothing streamed
    assert capsys.readouterr().out == _reference_answer(tiny_checkpoint, [{"role": "user", "content": "Hello"}], 4) + "\n"


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
@pytest.mark.parametrize("interrupt, stats_lines", [
    # a KeyboardInterrupt raised in the middle of the ops (as a second Ctrl-C does): no stats for that answer
    (_raise_keyboard_interrupt, 1),
    # a real SIGINT to this process: the answer ends one token later at most, its stats line printed
    (lambda: os.kill(os.getpid(), signal.SIGINT), 2),
], ids=["raised", "sigint"])
def test_chat_ctrl_c_stops_an_answer_and_the_next_one_is_unaffected(tiny_cli, tiny_checkpoint, capsys, monkeypatch,
                                                                    interrupt, stats_lines):
    """Ctrl-C while the second piece streams: the turn is dropped, the model and runtime stay usable, and the
    same question asked again gets the answer a fresh conversation gets."""
    lines = iter(["Hello", "Hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    chunks = []

    def print_now(text):
        chunks.append(text)
        if len(chunks) == 2:
            interrupt()
        print(text, end="")

    monkeypatch.setattr(cli, "_print_now", print_now)
    # Python's own handler, as in a terminal: a shell that starts a job in the background hands it SIGINT ignored
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.main([*tiny_cli, "--max-new-tokens", "12"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    finally:
        signal.signal(signal.SIGINT, outer)
    captured = capsys.readouterr()
    expected = _reference_answer(tiny_checkpoint, [{"role": "user", "content": "Hello"}], 12)
    assert captured.out.endswith(expected + "\n") and "answer stopped" in captured.err
    assert captured.err.count("[prefill:") == stats_lines


def test_python_dash_m_runs_the_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "torch_npu2", "generate", "--top-p", "2"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "argument --top-p: expected a number in (0, 1], got 2.0" in done.stderr


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_a_sigint_during_a_single_prompt_exits_130_with_or_without_json(tiny_cli, capsys, monkeypatch):
    from torch_npu2 import textgen

    generate = textgen.generate

    def generate_with_sigint(*args, on_text, **kwargs):  # a Ctrl-C once the first piece of text is out
        return generate(*args, on_text=lambda text: os.kill(os.getpid(), signal.SIGINT), **kwargs)

    monkeypatch.setattr(textgen, "generate", generate_with_sigint)
    for extra in ([], ["--json"]):
        assert cli.main([*tiny_cli, "--prompt", "Hello", "--max-new-tokens", "12", *extra]) == 130
        captured = capsys.readouterr()
        assert "interrupted" in captured.err and "Traceback" not in captured.err
        assert '"finish_reason"' not in captured.out


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_sigint_in_a_real_process_stops_the_answer_not_the_chat(tiny_checkpoint, tmp_path):
    """A real SIGINT, as a terminal's Ctrl-C sends: the answer stops, the chat goes on, /exit exits 0."""
    import select
    import subprocess
    import sys
    import time

    env = {**os.environ, "TORCH_NPU2_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    chat = subprocess.Popen([sys.executable, "-m", "torch_npu2", "generate", "--model", str(tiny_checkpoint),
                             "--backend", "emulator", "--max-new-tokens", "400"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        chat.stdin.write("Hello\n")
        chat.stdin.flush()
        deadline, seen = time.monotonic() + 120, b""
        while len(seen) < 20 and time.monotonic() < deadline:  # wait until the answer is streaming
            if select.select([chat.stdout], [], [], 0.5)[0]:
                seen += os.read(chat.stdout.fileno(), 4096)
        assert len(seen) >= 20, "the answer did not start streaming"
        chat.send_signal(signal.SIGINT)
        time.sleep(1)
        chat.stdin.write("/exit\n")
        chat.stdin.flush()
        assert chat.wait(timeout=60) == 0
    finally:
        chat.kill()
    err = chat.stderr.read()
    assert "answer stopped" in err and "Traceback" not in err


def _gguf_bytes(architecture: str, before=()) -> bytes:
    """A GGUF v3 header whose metadata holds ``before`` ((key, type, value) with type 4 = u32, 8 = string, 9 = array
    of strings) and then general.architecture; no tensors."""
    import struct

    def string(text):
        return struct.pack("<Q", len(text.encode())) + text.encode()

    def value(kind, item):
        if kind == 4:
            return struct.pack("<I", item)
        if kind == 8:
            return string(item)
        return struct.pack("<IQ", 8, len(item)) + b"".join(string(s) for s in item)

    pairs = [*before, ("general.architecture", 8, architecture)]
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs))
            + b"".join(string(key) + struct.pack("<I", kind) + value(kind, item) for key, kind, item in pairs))


def test_checkpoints_that_are_not_llama_models_are_refused_before_loading(tmp_path, capsys, no_model_load):
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    assert _usage_error(capsys, ["generate", "--model", str(tmp_path / "zip.gguf"), "--prompt", "x"]).endswith(
        f"argument --model: {tmp_path / 'zip.gguf'} is not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF')")
    (tmp_path / "cut.gguf").write_bytes(_gguf_bytes("llama")[:30])
    assert "is not a readable GGUF file (its metadata is truncated or malformed)" in _usage_error(
        capsys, ["generate", "--model", str(tmp_path / "cut.gguf"), "--prompt", "x"])
    (tmp_path / "gpt2.gguf").write_bytes(_gguf_bytes("gpt2", before=[("gpt2.context_length", 4, 1024),
                                                                      ("tokenizer.ggml.model", 8, "gpt2"),
                                                                      ("tokenizer.ggml.tokens", 9, ["a", "bc"])]))
    assert _usage_error(capsys, ["serve", "--model", str(tmp_path / "gpt2.gguf")]).endswith(
        f"argument --model: {tmp_path / 'gpt2.gguf'} holds a 'gpt2' model (general.architecture); torch_npu2 runs "
        "Llama-architecture models ('llama')")
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")  # config.json tells, weights or not
    assert _usage_error(capsys, ["generate", "--model", str(tmp_path / "gpt2"), "--prompt", "x"]).endswith(
        f"argument --model: {tmp_path / 'gpt2' / 'config.json'} describes a 'gpt2' model; torch_npu2 runs "
        "the model types 'llama' (Llama 2/3.x, SmolLM2, TinyLlama), 'qwen2' (Qwen2, Qwen2.5)")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    assert "config.json is not a readable JSON object" in _usage_error(
        capsys, ["compile", "--model", str(tmp_path / "broken")])
    (tmp_path / "llama.gguf").write_bytes(_gguf_bytes("llama", before=[("tokenizer.ggml.tokens", 9, ["x"])]))
    from torch_npu2.patch_llama.models import checkpoint_problem

    assert checkpoint_problem(tmp_path / "llama.gguf") is None


def test_a_seed_out_of_range_is_refused_before_loading(capsys, no_model_load):
    assert _usage_error(capsys, ["generate", "--seed", "99999999999999999999999", "--prompt", "x"]).endswith(
        "argument --seed: expected an int in [0, 18446744073709551615], got 99999999999999999999999")


def test_serve_ports_are_checked_by_binding_before_loading(capsys, monkeypatch, no_model_load):
    import socket

    pytest.importorskip("uvicorn", reason="serve needs uvicorn (pip install 'torch_npu2[serve]')")
    assert _usage_error(capsys, ["serve", "--port", "70000"]).endswith(
        "argument --port: expected a port number in [1, 65535], got 70000")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _usage_error(capsys, ["serve", "--port", str(port)]).endswith(
            f"argument --port: cannot listen on 127.0.0.1:{port}: Address already in use")
    from torch_npu2 import serve

    bound = []
    monkeypatch.setattr(serve, "run", lambda *args, sock, **kwargs: bound.append(sock.getsockname()) or 0)
    monkeypatch.setattr(cli, "_load_patched", lambda args: (None, None))
    assert cli.main(["serve", "--port", str(port)]) == 0 and bound == [("127.0.0.1", port)]


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_a_prompt_longer_than_the_context_is_one_error_line_and_a_chat_goes_on(tiny_cli, tmp_path, capsys,
                                                                             monkeypatch):
    """The tiny checkpoint's context is 512 tokens: a longer prompt file gets the same message as the Python API
    and the server, as an argparse-style error (exit 2) after the load and before any generation; in the chat the
    message is left out and the next one is answered."""
    from torch_npu2 import textgen

    (tmp_path / "long.txt").write_text("word " * 600)
    real_generate = textgen.generate
    monkeypatch.setattr(textgen, "generate", lambda *a, **k: pytest.fail("generation started"))
    line = _usage_error(capsys, [*tiny_cli, "--prompt-file", str(tmp_path / "long.txt")])
    assert line.startswith("torch-npu2 generate: error: argument --prompt-file: the prompt has ")
    assert line.endswith(" tokens, more than the 511 that leave room for an answer in the model's context of 512 "
                         "tokens (config.max_position_embeddings)")
    monkeypatch.setattr(textgen, "generate", real_generate)
    lines = iter(["word " * 600, "Hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    assert cli.main([*tiny_cli, "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "(the prompt has " in err and "that message is left out of the conversation, /reset starts over)" in err
    assert err.count("[prefill: ") == 1  # "Hello" was answered


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_loading_reports_its_steps_and_a_cut_off_answer_says_so(tiny_cli, capsys):
    assert cli.main([*tiny_cli, "--prompt", "Hello", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert err.index("  reading the tokenizer ...\n  reading the weights ...\n") < err.index("loaded in ")
    assert "[answer cut off at --max-new-tokens 3; a larger value lets it finish]\n[prefill: " in err


def test_info_prints_the_wheels_install_command_once(capsys, monkeypatch, tmp_path):
    from torch_npu2.kernels import toolchain

    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(toolchain.AIR_TOOLS_VARIABLE, str(tmp_path / "no-tools"))
    monkeypatch.setenv("PATH", str(tmp_path))
    cli.main(["info"])
    out = capsys.readouterr().out
    assert out.count(toolchain.INSTALL_HINT) == 1 and "the wheels' install command (below)" in out


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_serve_in_a_real_process_answers_on_the_port_it_bound_and_ctrl_c_stops_it(tiny_checkpoint, tmp_path):
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("uvicorn", reason="serve needs uvicorn (pip install 'torch_npu2[serve]')")
    with socket.socket() as probe:  # a free port (released again for the server to take)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "TORCH_NPU2_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-m", "torch_npu2", "serve", "--model", str(tiny_checkpoint),
                               "--backend", "emulator", "--port", str(port), "--model-name", "tiny"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout.readline().startswith(f"serving tiny at http://127.0.0.1:{port}/v1 ")
        body = json.dumps({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    assert json.loads(answer.read())["usage"]["completion_tokens"] == 3
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.2)
        server.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly, then re-raises it; serve returns 0
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
    err = server.stderr.read()
    assert "Application shutdown complete" in err and "Traceback" not in err


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_the_chat_prefills_only_each_new_turn(tiny_cli, tiny_checkpoint, capsys, monkeypatch):
    """The second turn reuses the first turn's cache (its stats line says how much) and answers as a fresh run of
    the whole conversation; after /reset the same first message is a fresh prompt."""
    lines = iter(["Hello", "Tell me more", "/reset", "Hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    assert cli.main([*tiny_cli, "--max-new-tokens", "4", "--no-stream"]) == 0
    captured = capsys.readouterr()
    stats = [line for line in captured.err.splitlines() if line.startswith("[prefill:")]
    assert len(stats) == 3
    assert "cached" not in stats[0] and "of them cached)" in stats[1] and "cached" not in stats[2]
    first, second, third = captured.out.splitlines()[-3:]
    assert third == first
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
                    {"role": "user", "content": "Tell me more"}]
    assert second == _reference_answer(tiny_checkpoint, conversation, 4)


def test_weights_other_than_a_gguf_files_own_are_refused_before_loading(capsys, no_model_load):
    pytest.importorskip("gguf", reason="reading a GGUF header needs gguf")
    from torch_npu2.patch_llama.models import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    for command in (["generate", "--prompt", "x"], ["serve"]):
        line = _usage_error(capsys, [*command, "--weights", "q4_0"])
        assert line.endswith("argument --weights: SmolLM2-135M-Instruct.Q4_1.gguf holds Q4_1 projections; a GGUF "
                             "file runs in its own packed format (--weights native) or dequantized (--weights bf16); "
                             "q4_0 quantizes a bf16 HF checkpoint at patch time"), line
    assert "argument --weights: invalid choice: 'q5_k'" in _usage_error(capsys, ["generate", "--weights", "q5_k"])


def test_an_lm_head_choice_for_a_packed_model_is_refused_before_loading(capsys, no_model_load, tiny_checkpoint):
    line = _usage_error(capsys, ["generate", "--prompt", "x", "--model", str(tiny_checkpoint), "--weights", "q4_1",
                                 "--lm-head", "bf16"])
    assert line.endswith(f"argument --lm-head: bf16 chooses between copies of a bf16 LM head; {tiny_checkpoint.name} "
                         "runs packed (q4_1), and its LM head with it (--lm-head auto, or --weights bf16)"), line
    line = _usage_error(capsys, ["serve", "--lm-head", "q8_0"])  # the default model: a Q4_1 GGUF file
    assert line.endswith("argument --lm-head: q8_0 chooses between copies of a bf16 LM head; "
                         "SmolLM2-135M-Instruct.Q4_1.gguf runs packed, as the GGUF file holds it, and its LM head with "
                         "it (--lm-head auto, or --weights bf16)"), line
    assert "argument --lm-head: invalid choice: 'q4_1'" in _usage_error(capsys, ["generate", "--lm-head", "q4_1"])


def test_an_lm_head_choice_passes_for_a_gguf_file_that_loads_dequantized(no_model_load, monkeypatch):
    """A GGUF file whose projections are not all of one packed format loads in bf16 (--weights native), so its LM
    head's copy can be chosen: the checks pass and the (refused, here) model load is reached."""
    pytest.importorskip("gguf", reason="reading a GGUF header needs gguf")
    from torch_npu2.patch_llama import gguf_file
    from torch_npu2.patch_llama.models import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    monkeypatch.setattr(gguf_file, "projection_types", lambda path: {"q4_1", "q6_k"})
    with pytest.raises(AssertionError, match="the model was loaded before the arguments were checked"):
        cli.main(["generate", "--prompt", "x", "--lm-head", "q8_0"])


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
@pytest.mark.parametrize("lm_head", ["bf16", "q8_0"])
def test_generate_passes_the_lm_head_choice_to_patch_llama(tiny_checkpoint, tmp_path, capsys, monkeypatch, lm_head):
    import torch_npu2

    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path / "cache"))
    chosen = []
    patch = torch_npu2.patch_llama

    def recording_patch(model, **kwargs):
        chosen.append(kwargs["lm_head"])
        return patch(model, **kwargs)

    monkeypatch.setattr(torch_npu2, "patch_llama", recording_patch)
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "Hello", "--max-new-tokens", "4",
                     "--backend", "emulator", "--no-stream", "--lm-head", lm_head]) == 0
    assert chosen == [lm_head]
    answer = capsys.readouterr().out.splitlines()[-1]
    assert answer == _reference_answer(tiny_checkpoint, [{"role": "user", "content": "Hello"}], 4)


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
def test_generate_quantizes_a_bf16_checkpoint_at_patch_time(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "Hello", "--max-new-tokens", "4",
                     "--backend", "emulator", "--weights", "q4_1"]) == 0
    err = capsys.readouterr().err
    assert "weights: q4_1 (checkpoint, quantized at patch: " in err and "decode: 4 tokens, " in err


def test_info_shows_each_models_weight_format_and_bytes(capsys, monkeypatch, tmp_path, tiny_checkpoint):
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path))
    cli.main(["info", "--model", str(tiny_checkpoint)])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("--model: "))
    assert "MiB of weights (BF16 ×" in line and "decode reads bf16 (default; --weights q4_1|q4_0|q8_0" in line
    try:
        from torch_npu2.patch_llama.models import default_model_path

        default_model_path()
    except FileNotFoundError:
        return  # the default model is not installed: info says so instead
    assert ("default model: SmolLM2-135M-Instruct.Q4_1.gguf: 92.1 MiB of weights (F32 ×61 0.1 MiB, Q4_1 ×210 63.3 "
            "MiB, Q8_0 ×1 28.7 MiB; 256.6 MiB in bf16); decode reads Q4_1 packed") in out
