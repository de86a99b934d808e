"""Production-shaped (randomly initialised) Qwen3-VL-8B and Qwen3-8B checkpoints, offline.

Why: compute cost does not depend on weight values, so a checkpoint with the real
architecture, a tokenizer with the real vocabulary size and the real image-processor
settings costs what the real model costs per image / per caption, without downloading
anything. The text it generates is noise; only throughput and memory mean anything.

Config sources (public copies of the Hugging Face ``config.json`` files, found with the
code search; the values agree across every copy seen):

- Qwen3-VL-8B-Instruct (``QWEN3_VL_8B``): ``NVIDIA/TensorRT-LLM``
  ``tests/unittest/_torch/modeling/test_modeling_qwen3vl.py`` (``QWEN3_VL_8B_CONFIG``, which
  trims ``num_hidden_layers`` to 4 and notes "36 layers for full model"); the full 36-layer
  text config with the same vision config is vendored verbatim elsewhere too (a Swift test
  of a Qwen3-VL port, an Alpamayo/Cosmos-Reason2-8B port). Text: hidden 4096, 36 layers,
  32 heads, 8 KV heads, head_dim 128, intermediate 12288, vocab 151936, rope_theta 5e6,
  interleaved M-RoPE sections [24, 20, 20], untied embeddings. Vision: depth 27, hidden 1152,
  intermediate 4304, 16 heads, patch 16, temporal patch 2, spatial merge 2, 2304 position
  embeddings, deepstack layers [8, 16, 24], out_hidden 4096. 8.77B parameters (model card).
- Qwen3-8B (``QWEN3_8B``): ``Chen-Oliver/qwen3-8b-base`` ``config.json`` (Qwen3-8B-Base,
  the same architecture): hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128,
  intermediate 12288, vocab 151936, rope_theta 1e6, untied embeddings. The chat model's
  ``max_position_embeddings`` is 40960 (several vendored Qwen3-8B configs; the Base file says
  32768); it sizes nothing at these sequence lengths. 8.19B parameters.
- Image processor (``QWEN3_VL_IMAGE_PROCESSOR``): ``Qwen2VLImageProcessorFast`` with
  ``size = {shortest_edge: 65536, longest_edge: 16777216}`` (256^2 .. 4096^2 pixels), patch 16,
  temporal patch 2, merge 2, mean/std 0.5, as in the Qwen3-VL / Qwen3.5 ``preprocessor_config``
  files vendored in several public repositories (these hits carried no repository name).
  A 1024x1024 input becomes 64x64 patches = 1024 merged vision tokens.

Not reproduced: the real BPE merges (the tokenizer here is trained offline on the prompt
texts, so words cost about one token each, somewhat fewer than the real tokenizer's ~1.3
per English word) and the real special-token ids (ours are 0..8; ids only index tables).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

from prx_assets.core.captions.models.prompts import (
    CAPTION_SYSTEM_PROMPT,
    CAPTION_USER_PROMPT,
    CLASSIFIER_PROMPT,
)

VOCAB_SIZE = 151936

QWEN3_VL_8B: dict[str, Any] = {
    "text_config": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB_SIZE,
        "initializer_range": 0.02,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
        "out_hidden_size": 4096,
        "initializer_range": 0.02,
    },
    "tie_word_embeddings": False,
}

QWEN3_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB_SIZE,
    "initializer_range": 0.02,
}

QWEN3_VL_IMAGE_PROCESSOR: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

#: Parameter counts of the released checkpoints, to check the configs above against.
EXPECTED_PARAMS = {"qwen3_vl_8b": 8.77e9, "qwen3_8b": 8.19e9}

# Same layer kinds, tiny widths: the whole flow on a CPU in seconds (--tiny).
TINY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "deepstack_visual_indexes": [0],
    "out_hidden_size": 64,
}

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
]

# Qwen-style turns; image items become vision pads; ``enable_thinking=False`` adds the empty
# think block Qwen3's own template adds (the classifier passes it).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

CAPTION_WORDS = (
    "a an the of on in with and near above below behind beside under over across into "
    "photograph photo illustration render screenshot scan close-up wide shot portrait "
    "landscape interior exterior view viewed from eye level low angle aerial overhead "
    "red orange yellow green blue purple pink brown grey gray black white beige golden silver "
    "warm cool soft harsh diffuse natural artificial daylight sunlight shadow shadows "
    "highlight highlights glow reflection reflections backlit overcast dusk dawn night "
    "wooden metal glass stone brick concrete fabric leather paper plastic ceramic marble "
    "smooth rough glossy matte textured grainy blurred sharp focus shallow depth field "
    "bokeh background foreground centre left right top bottom corner edge frame "
    "woman man child person people dog cat bird horse car bicycle bus street road building "
    "house window door wall floor ceiling table chair sofa bed lamp plant tree trees flower "
    "flowers grass field mountain mountains river lake sea beach sand sky clouds sun moon "
    "water snow rock rocks forest garden city skyline bridge tower sign poster logo text "
    "letters words label watermark border caption cup mug plate bowl bottle book laptop "
    "phone camera rocket astronaut helmet suit coins gravel retina cells galaxy stars "
    "small large tall short round square long narrow thin thick old new bright dark pale "
    "vivid muted saturated contrast noise compression banding overexposed underexposed "
    "stands sits lies holds wears rests hangs leans fills covers surrounds shows appears"
).split()


def synthetic_captions(n: int, words: int = 150, seed: int = 0) -> list[str]:
    """``n`` captions of ``words`` descriptive words each (deterministic)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(CAPTION_WORDS) for _ in range(words)) + "." for _ in range(n)]


def _corpus() -> list[str]:
    prompts = [CAPTION_SYSTEM_PROMPT, CAPTION_USER_PROMPT, CLASSIFIER_PROMPT]
    return prompts * 20 + synthetic_captions(400, seed=1)


def _filler_tokens(taken: set[str], count: int) -> list[str]:
    """``count`` distinct byte-level tokens ('Ġ' + letters) absent from ``taken``."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    i = 0
    while len(out) < count:
        n, word = i + 26 * 27, ""
        while n:
            n, r = divmod(n, 26)
            word = letters[r] + word
        tok = "\u0120" + word
        if tok not in taken:
            out.append(tok)
        i += 1
    return out


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A Qwen2TokenizerFast with exactly ``vocab_size`` ids, trained here on the prompts.

    Every id decodes to text (ids the BPE did not learn are filler pseudo-words), so a
    random model's greedy output is never empty and ``len(tokenizer)`` matches the model's
    embedding table as in the real checkpoint.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    if len(vocab) > vocab_size:
        raise ValueError(f"trained vocab {len(vocab)} exceeds vocab_size {vocab_size}")
    for tid, text in enumerate(_filler_tokens(set(vocab), vocab_size - len(vocab)), len(vocab)):
        vocab[text] = tid
    tok = Tokenizer.from_str(json.dumps(data))
    hf = Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    hf.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    if len(hf) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(hf)} ids, expected {vocab_size}")
    return hf


def vl_config(tokenizer: Any, tiny: bool) -> Any:
    """Qwen3VLConfig with the real (or tiny) shapes and this tokenizer's special ids."""
    from transformers import Qwen3VLConfig

    spec = copy.deepcopy(QWEN3_VL_8B)
    if tiny:
        spec["text_config"].update(TINY_TEXT)
        spec["text_config"]["rope_scaling"]["mrope_section"] = [4, 2, 2]
        spec["vision_config"].update(TINY_VISION)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return Qwen3VLConfig(
        **spec,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def lm_config(tokenizer: Any, tiny: bool) -> Any:
    from transformers import Qwen3Config

    spec = dict(QWEN3_8B)
    if tiny:
        spec.update(TINY_TEXT)
    return Qwen3Config(
        **spec,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )


def vl_processor(tokenizer: Any) -> Any:
    from transformers import Qwen2VLImageProcessorFast, Qwen3VLProcessor, Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorFast(**QWEN3_VL_IMAGE_PROCESSOR),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2),
        chat_template=CHAT_TEMPLATE,
    )


def param_count_on_meta(kind: str) -> int:
    """Parameters of the full-size architecture, counted without allocating (meta device)."""
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        if kind == "qwen3_vl_8b":
            from transformers import Qwen3VLConfig

            model: Any = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**QWEN3_VL_8B))
        elif kind == "qwen3_8b":
            from transformers import Qwen3Config

            model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_8B))
        else:
            raise ValueError(f"unknown model kind {kind!r}")
    return sum(p.numel() for p in model.parameters())


def build_vl_checkpoint(out: Path, tokenizer: Any, tiny: bool, device: str) -> dict[str, float]:
    """Random bf16 (fp32 when tiny on CPU) Qwen3-VL built on ``device``, saved with processor.

    EOS is removed from the generation config so every row decodes exactly
    ``max_new_tokens`` (random weights would otherwise stop at a random step).
    """
    import time

    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(vl_config(tokenizer, tiny), dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    _sync(device)
    t1 = time.perf_counter()
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    vl_processor(tokenizer).save_pretrained(out)
    t2 = time.perf_counter()
    del model
    return {"params": n_params, "construct_s": t1 - t0, "save_s": t2 - t1, **_disk(out)}


def build_lm_checkpoint(out: Path, tokenizer: Any, tiny: bool, device: str) -> dict[str, float]:
    import time

    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    torch.manual_seed(1)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(lm_config(tokenizer, tiny), dtype=dtype)
    _sync(device)
    t1 = time.perf_counter()
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    t2 = time.perf_counter()
    del model
    return {"params": n_params, "construct_s": t1 - t0, "save_s": t2 - t1, **_disk(out)}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _disk(path: Path) -> dict[str, float]:
    return {"checkpoint_gib": sum(f.stat().st_size for f in path.iterdir()) / 2**30}
