"""A tiny, deterministic HF causal LM and chat tokenizer for tests, built in-process (no model hub).

`tiny_tokenizer()` trains a byte-level BPE on a few lines of agent-style text and wraps it as a
`PreTrainedTokenizerFast` with ChatML special tokens and a ChatML chat template. `tiny_model(vocab_size)`
is a 2-layer `Qwen2ForCausalLM` with seeded random weights in float32. Both take well under a second.
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "Thought:\nI should look around first.\n\nAction:\nlook around",
    "Thought:\nThe key is on the table.\n\nAction:\npick up key",
    "Action:\ngo to red ball 1\nAction:\nopen door\nAction:\ntoggle and go through door",
    "Invalid action. Nothing happens. You see a red ball, a blue key and a door.",
    "Plan ahead: list the next 3 actions you will take, starting with the action you take right now, "
    "one action per line. Next action?",
    "get 1 bone; craft 4 stick using 2 oak planks; inventory; move forward; turn left; turn right",
]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def tiny_model(vocab_size: int, seed: int = 0, layers: int = 2) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    # Default init is std 0.02: logits are then almost uniform, and every KL is ~0. Larger weights make
    # the model's output depend visibly on its context.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


def tiny_checkpoint(folder) -> None:
    """A tiny random Qwen2 (``tiny_model``) and the tiny tokenizer saved in ``folder``, the model's generation end
    token the tokenizer's."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def pass_through_qwen2(vocab_size: int, hidden_size: int, eos_token_id, layers: int = 1,
                       max_positions: int = 2048) -> Qwen2ForCausalLM:
    """A tiny untied Qwen2 whose attention and MLP blocks add nothing to the residual stream (their output
    projections are zero): the last hidden state is norm(embedding of the current token), so a test sets the replies
    it gives through ``embed_tokens`` and ``lm_head`` alone. Heads of 64 wide, as vLLM needs."""
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=hidden_size // 64, num_key_value_heads=1,
                         max_position_embeddings=max_positions, tie_word_embeddings=False, eos_token_id=eos_token_id)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def hf_logits_fn(model):
    """Adapter: a HF causal LM as `logits_fn(sequences, attention_mask, position_ids, keep=None) -> logits` (float32;
    `keep`: the columns to compute, HF's logits_to_keep)."""

    @torch.no_grad()
    def logits_fn(sequences, attention_mask, position_ids, keep=None):
        return model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids,
                     logits_to_keep=0 if keep is None else keep).logits.float()

    return logits_fn


def agent_response(tokenizer, observations, actions, reward=0.0) -> dict:
    """What OpenRLHF's `MultiTurnAgentExecutor.execute` returns for a ChatML conversation: the first
    observation as the chat-formatted prompt, each action's tokens ending with <|im_end|>, and each
    observation after it wrapped in the template's turn markers. ``len(observations) == len(actions) + 1``
    (the last observation is the feedback to the last action)."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    tokens = enc(tokenizer.apply_chat_template([{"role": "user", "content": observations[0]}], tokenize=False,
                                               add_generation_prompt=True))
    ranges = []
    for action, feedback in zip(actions, observations[1:]):
        start = len(tokens)
        tokens += enc(action) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        ranges.append((start, len(tokens)))
        tokens += enc(f"\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n")
    return {
        "prompt": observations[0], "label": "", "observation_tokens": tokens, "action_ranges": ranges,
        "reward": reward, "scores": reward, "rollout_log_probs": None, "truncated": False, "extra_logs": {},
    }


def to_experience(response: dict, max_len: int = 4096):
    """OpenRLHF's own response -> Experience conversion (SamplesGenerator._process_response_into_experience)."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    return object.__new__(SamplesGenerator)._process_response_into_experience(response, max_len=max_len)


def stock_grpo(experiences: list, n: int, kl_coef: float = 0.0, reward_clip: tuple | None = None) -> list:
    """OpenRLHF's own GRPO advantages and returns (``RemoteExperienceMaker.compute_advantages_and_returns`` with the
    group_norm estimator, KL in the reward at ``kl_coef``, ``--reward.clip_range`` at ``reward_clip``: None here,
    (-10, 10) in ``train_ppo_ray``), set in place on experiences with ``index`` and ``kl``."""
    from types import SimpleNamespace

    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator="group_norm", gamma=1.0, lambd=1.0, no_std_norm=False),
                             kl=SimpleNamespace(use_loss=kl_coef == 0.0, estimator="k1"),
                             dynamic_filtering_enable=False),
        rollout=SimpleNamespace(n_samples_per_prompt=n, max_new_tokens=None),
        reward=SimpleNamespace(clip_range=reward_clip, overlong_buffer_len=None, stop_properly_penalty_coef=None),
    )
    maker = RemoteExperienceMaker(None, None, None, None, SimpleNamespace(value=kl_coef), SimpleNamespace(args=args),
                                  SimpleNamespace(pad_token_id=0))
    return maker.compute_advantages_and_returns(experiences)
