"""The packaged GGUF's weights in the two forms the peers load: a Hugging Face Llama directory and an F16 GGUF.

- **Hugging Face directory** (for vLLM): transformers reads and dequantizes the packaged Q4_1 GGUF with
  its own code (the oracle's loader), and saves the model as it would any Llama: ``config.json``,
  ``model.safetensors`` at float32, the tokenizer with its chat template, ``generation_config.json``.
- **F16 GGUF** (for llama.cpp's server at 16 bits): llama.cpp's own converter
  (``convert_hf_to_gguf.py``, from the sources ``setup_llama_server.sh`` unpacked, run with its own
  ``gguf-py`` by the peers' Python, vLLM's venv, which has the sentencepiece module it imports) writes that directory as a GGUF of float16 weights. Both peers thus serve the same
  dequantized numbers that chapter 8 multiplies.

    python -m benchmarks.studies.real_model_peers.export
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from shared.paths import REPO_ROOT

EXPORT_ROOT = REPO_ROOT / ".cache" / "real-model-peers"
HF_DIR = EXPORT_ROOT / "smollm2-hf"
F16_GGUF = EXPORT_ROOT / "smollm2-f16.gguf"
LLAMA_CPP_ROOT = REPO_ROOT / ".llama-cpp"
PEER_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def llama_cpp_sources(root: Path = LLAMA_CPP_ROOT) -> Path:
    """The llama.cpp sources ``setup_llama_server.sh`` unpacked (the one vendored tree under ``root``)."""
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise FileNotFoundError(f"no llama.cpp sources under {root}: run `bash benchmarks/studies/real_model_peers/setup_llama_server.sh`")
    return found[-1]


def export_hf(out: Path = HF_DIR) -> Path:
    """The packaged model as transformers loads it from the GGUF, saved as a Hugging Face Llama directory."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from shared.weights import smollm2_path

    gguf = smollm2_path()
    model = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers marks a model read from a GGUF as quantized and refuses to save it; the same weights
    # in a model built from the config alone save as any Llama's.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config).to(torch.float32)
    plain.load_state_dict(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    plain.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def export_f16_gguf(hf_dir: Path = HF_DIR, out: Path = F16_GGUF, python: Path = PEER_PYTHON) -> Path:
    """``hf_dir`` written as an F16 GGUF by llama.cpp's converter, with the gguf-py of the same sources."""
    sources = llama_cpp_sources()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sources / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([str(python), str(sources / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f16",
                    "--outfile", str(out)], check=True, env=env)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.real_model_peers.export", description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", type=Path, default=HF_DIR)
    parser.add_argument("--f16-gguf", type=Path, default=F16_GGUF)
    parser.add_argument("--skip-gguf", action="store_true", help="write only the Hugging Face directory")
    args = parser.parse_args(argv)
    print(export_hf(args.hf_dir))
    if not args.skip_gguf:
        print(export_f16_gguf(args.hf_dir, args.f16_gguf))


if __name__ == "__main__":
    main()
