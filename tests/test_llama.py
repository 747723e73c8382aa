"""The Llama family in ``shared/``: SmolLM2 from its GGUF against transformers, the loaders, the chat template.

The oracle is transformers' ``LlamaForCausalLM`` loading the same GGUF file with its own code
(``tests/llama_oracle.py``); a Hugging Face directory is checked against transformers' own model
saved to it. Small GGUF files are written here with ``gguf``'s writer, from a seeded ``llama-tiny``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.chat_template import ChatTemplateError, chat_prompt
from shared.generation import greedy_generate, reference_greedy
from shared.model import PRESETS, DynamicKVCache
from shared.weights import WeightsError, load_model

ROOT = Path(__file__).resolve().parent.parent
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS = [
    FRANCE,
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour of the sky?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a Python function that adds two numbers."}],
]
TEXTS = ["Hello world 12345 and 3.14!", "<|im_start|>user\nWhat's 2+2?<|im_end|>\n",
         "  spaces\n\n\ttabs  ünïcödé 日本語 😀", "def f(x):\n    return x**2  # 1000000"]


def test_the_packaged_gguf_gives_transformers_logits(smollm2, llama_oracle) -> None:
    ids = smollm2.tokenizer.encode(chat_prompt(smollm2.tokenizer, FRANCE))
    with torch.no_grad():
        ours = smollm2.model(torch.tensor([ids]))[0]
    theirs = llama_oracle.logits(ids)
    assert ours.shape == theirs.shape == (len(ids), 49152)
    assert (ours - theirs).abs().max() < 1e-3 * theirs.abs().max()


def test_the_tokenizer_and_chat_template_are_transformers(smollm2, llama_oracle) -> None:
    for text in TEXTS:
        assert smollm2.tokenizer.encode(text) == llama_oracle.tokenizer.encode(text, add_special_tokens=False), text
        ids = smollm2.tokenizer.encode(text)
        assert smollm2.tokenizer.decode(ids) == text
    for messages in CONVERSATIONS:
        assert chat_prompt(smollm2.tokenizer, messages) == llama_oracle.chat_prompt(messages)
    assert smollm2.tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]  # control tokens are single ids
    assert smollm2.tokenizer.eos_id == 2


def test_greedy_answers_are_transformers_and_make_sense(smollm2, llama_oracle) -> None:
    for messages in CONVERSATIONS[:2]:
        ids = smollm2.tokenizer.encode(chat_prompt(smollm2.tokenizer, messages))
        expected = llama_oracle(ids, 12)
        assert greedy_generate(smollm2.model, ids, 12) == expected  # KV cache of 3 heads, one token a step
        assert reference_greedy(smollm2.model, ids, 12) == expected
    answer = smollm2.tokenizer.decode(llama_oracle(smollm2.tokenizer.encode(chat_prompt(smollm2.tokenizer, FRANCE)), 8))
    assert answer.startswith("The capital of France is Paris.")


# bf16 weights and activations against transformers at fp32, next token by next token along the oracle's
# answer (teacher-forced: one early flip would otherwise count every later token as a miss). The lessons
# state this bound for the real model.
BF16_MIN_NEXT_TOKEN_AGREEMENT = 0.95
MORE_QUESTIONS = [[{"role": "user", "content": question}] for question in
                  ("Tell me a joke.", "What is 7 times 8?", "Name three colours.", "Why is the sea salty?")]


@pytest.mark.slow
def test_bf16_keeps_the_stated_agreement_with_transformers(llama_oracle) -> None:
    bf16 = load_model("smollm2", dtype=torch.bfloat16)
    same = total = 0
    for messages in CONVERSATIONS + MORE_QUESTIONS:
        ids = bf16.tokenizer.encode(chat_prompt(bf16.tokenizer, messages))
        expected = llama_oracle(ids, 24)
        with torch.no_grad():
            predicted = bf16.model(torch.tensor([ids + expected]))[0, len(ids) - 1:-1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(predicted, expected))
        total += len(expected)
    assert same / total >= BF16_MIN_NEXT_TOKEN_AGREEMENT, f"{same}/{total} next tokens agree"


def test_the_cache_holds_key_value_heads_only(smollm2) -> None:
    config = smollm2.config
    assert (config.n_head, config.kv_heads, config.head_dim) == (9, 3, 64)
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 64 * 2  # keys and values, 30 layers, 3 heads of 64
    cache = DynamicKVCache(config.n_layer)
    smollm2.model.prefill(torch.tensor([[1, 2, 3]]), None, None, cache)
    assert cache.read(0)[0].shape == (1, 3, 3, 64)


def test_loading_the_packaged_file_reports_its_time(smollm2) -> None:
    assert smollm2.source == "gguf:SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2.load_seconds > 0
    assert smollm2.config.n_ctx == 512  # served context: the model's 8192 capped by default


# ---------------------------------------------------------------------------------------------------
# Small files written here: a Hugging Face directory, GGUF files good and bad
# ---------------------------------------------------------------------------------------------------


def hf_llama_directory(tmp_path: Path, tokenizer) -> tuple[Path, object]:
    """transformers' own random Llama (GQA, untied head) saved as a Hugging Face directory with ``tokenizer``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=50000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
                                                                 "chat_template": tokenizer.chat_template}))
    return tmp_path, model


def test_a_hugging_face_llama_directory_gives_transformers_logits(tmp_path, smollm2) -> None:
    directory, theirs = hf_llama_directory(tmp_path, smollm2.tokenizer)
    loaded = load_model(str(directory))
    assert loaded.config.family == "llama" and not loaded.config.tie_word_embeddings and loaded.config.kv_heads == 2
    ids = loaded.tokenizer.encode(chat_prompt(loaded.tokenizer, FRANCE))
    with torch.no_grad():
        assert torch.allclose(loaded.model(torch.tensor([ids]))[0], theirs(torch.tensor([ids])).logits[0], atol=1e-5)
    assert loaded.tokenizer.eos_id == 2


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a query or key projection: rows (i, i + D/2) of a head interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-character table in byte order, then two specials: with no merges, a byte-level BPE
    over these is the byte tokenizer (id b is byte b)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte], extra = chr(256 + extra), extra + 1
    return [table[b] for b in range(256)] + ["<|endoftext|>", "<|pad|>"]


def write_gguf(path: Path, architecture: str = "llama", tensor_override: dict | None = None, context: int = 512):
    """``llama-tiny`` (seeded) as llama.cpp writes a Llama GGUF: its keys, permuted q/k rows, F32 tensors."""
    import gguf

    model = load_model("dummy", "llama-tiny", seed=3).model
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.n_layer)
    writer.add_context_length(context)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.mlp_width)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([1] * 256 + [3, 3])
    writer.add_token_merges([])
    writer.add_eos_token_id(256)
    state = {name: t.numpy() for name, t in model.state_dict().items()}
    tensors = {"token_embd.weight": state["embed_tokens.weight"], "output_norm.weight": state["norm.weight"]}
    q_rows, kv_rows = config.n_embd, config.kv_width
    for i in range(config.n_layer):
        qkv = state[f"layers.{i}.self_attn.qkv_proj.weight"]
        gate, up = np.split(state[f"layers.{i}.mlp.gate_up_proj.weight"], 2)
        tensors |= {f"blk.{i}.attn_q.weight": llama_cpp_permute(qkv[:q_rows], config.n_head),
                    f"blk.{i}.attn_k.weight": llama_cpp_permute(qkv[q_rows:q_rows + kv_rows], config.kv_heads),
                    f"blk.{i}.attn_v.weight": qkv[q_rows + kv_rows:],
                    f"blk.{i}.attn_output.weight": state[f"layers.{i}.self_attn.o_proj.weight"],
                    f"blk.{i}.ffn_gate.weight": gate, f"blk.{i}.ffn_up.weight": up,
                    f"blk.{i}.ffn_down.weight": state[f"layers.{i}.mlp.down_proj.weight"],
                    f"blk.{i}.attn_norm.weight": state[f"layers.{i}.input_layernorm.weight"],
                    f"blk.{i}.ffn_norm.weight": state[f"layers.{i}.post_attention_layernorm.weight"]}
    for name, array in {**tensors, **(tensor_override or {})}.items():
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def test_a_gguf_written_as_llama_cpp_writes_it_loads_back_exactly(tmp_path) -> None:
    original = write_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(str(tmp_path / "tiny.gguf"))
    assert loaded.config.rms_norm_eps == pytest.approx(1e-5)  # GGUF stores it as a float32
    assert dataclasses.replace(loaded.config, rms_norm_eps=1e-5) == PRESETS["llama-tiny"]
    ids = loaded.tokenizer.encode("the clever fox 12")
    assert ids == list(b"the clever fox 12")  # the byte-level BPE with no merges is the byte tokenizer
    with torch.no_grad():
        assert torch.allclose(loaded.model(torch.tensor([ids])), original(torch.tensor([ids])), atol=1e-5)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        chat_prompt(loaded.tokenizer, FRANCE)


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: p.write_bytes(b"PK\x03\x04 not a model"), "is not a GGUF file"),
    (lambda p: write_gguf(p, architecture="gpt2"), "architecture 'gpt2' is not read here"),
    (lambda p: write_gguf(p, tensor_override={"blk.0.attn_v.weight": np.zeros((128, 256), np.float64)}),
     "quantized as F64, which gguf cannot dequantize"),
])
def test_a_file_that_cannot_be_served_is_refused_with_its_reason(tmp_path, make, says) -> None:
    path = tmp_path / "model.gguf"
    make(path)
    with pytest.raises(WeightsError, match=says):
        load_model(str(path))


def test_a_context_longer_than_the_models_is_refused(tmp_path) -> None:
    write_gguf(tmp_path / "tiny.gguf", context=256)
    with pytest.raises(WeightsError, match="--context 300 is longer than the model's context of 256"):
        load_model(str(tmp_path / "tiny.gguf"), context=300)
    assert load_model(str(tmp_path / "tiny.gguf"), context=100).config.n_ctx == 100


def test_a_directory_without_weights_or_tokenizer_is_refused(tmp_path, smollm2) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(WeightsError, match="needs config.json and \\*.safetensors"):
        load_model(str(tmp_path))
    directory, _ = hf_llama_directory(tmp_path / "hf", smollm2.tokenizer)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(WeightsError, match="no tokenizer.json"):
        load_model(str(directory))


@pytest.mark.parametrize("chapter", ["ch01_flask_sync", "ch08_continuous_batching"])
def test_a_server_given_weights_it_cannot_serve_says_why_in_one_line_and_exits_2(tmp_path, chapter) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    done = subprocess.run([sys.executable, "-m", f"chapters.{chapter}", "--port", "0", "--weights", str(bad)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == f"python -m chapters.{chapter}: error: {bad} is not a GGUF file (it does not start with b'GGUF')"
    assert "Traceback" not in done.stderr


def test_the_climb_on_smollm2_checks_its_vocabulary_and_keeps_its_results_apart(smollm2) -> None:
    from benchmarks.harness.profiles import get_profile

    plain, real = get_profile("cpu"), get_profile("cpu", "smollm2")
    assert plain.results_name == "cpu" and plain.vocab_size == 258
    assert real.results_name == "cpu-smollm2" and real.vocab_size == smollm2.model.config.vocab_size
    assert [a for a in real.server_args() if a.startswith("--weights")] == ["--weights=smollm2"]
    assert real.levels == plain.levels
    # Chapter 1 answers one request at a time: 64 users' first answers on the real model take minutes,
    # and Locust's run must last that long before the level's window opens.
    from benchmarks.harness.loadgen import LevelPlan, locust_command
    from benchmarks.harness.workload import get_workload

    plan = LevelPlan(users=64, min_s=real.min_level_s, max_s=real.max_level_s, target_requests=1, workload=get_workload("default"),
                     seed=0, vocab_size=real.vocab_size, request_timeout_s=real.request_timeout_s, first_round_s=real.first_round_s)
    command = locust_command("http://127.0.0.1:1", plan, Path("level"))
    assert int(command[command.index("-t") + 1].removesuffix("s")) >= real.max_level_s + 64 * 2
    assert real.request_timeout_s >= 64 * 2 > plain.request_timeout_s


def test_the_gpu_profile_serves_the_real_model(smollm2) -> None:
    from benchmarks.harness.profiles import SMOLLM2_VOCAB, get_profile

    gpu = get_profile("gpu")
    assert [a for a in gpu.server_args() if a.startswith("--weights")] == ["--weights=smollm2"]
    assert gpu.vocab_size == SMOLLM2_VOCAB == smollm2.model.config.vocab_size
