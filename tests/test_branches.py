"""Branch packing: the production signals (``frozen_signals``: info gain and TE members; ``forecast.forecast_loss``:
loss and gradients) equal the per-turn / per-sample references of ``cope_rlhf/signal_references.py`` (float32, 1e-5) on a
small real HF model, for trajectories of 1, 3 and 20 turns, padded left and right, with a turn cut by the context
window."""

import contextlib
import random

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience

from cope_rlhf.branches import (
    BRANCH_ATTENTION, Branch, additive_mask, block_attention, branch_attention, contiguous_span, dense_mask,
    flex_available, flex_mask, layout_mask, pack_rows,
)
from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import build_forecast_samples, forecast_loss, pack_forecast_samples
from cope_rlhf.frozen_signals import frozen_signals
from cope_rlhf.info_gain import plan_probes
from cope_rlhf.temporal_ensemble import TOP_M, collect_members, te_status
from cope_rlhf.turns import turn_spans, unpadded_trajectories
from cope_rlhf.signal_references import assert_same_top_m, per_sample_forecast_loss, per_turn_info_gain
from tests.tiny_hf import agent_response, hf_logits_fn, tiny_model, to_experience

P = 6
ACTIONS = ["Action:\nlook around", "Thought:\nThe key is on the table.\n\nAction:\npick up key", "Action:\nopen door",
           "Action:\ngo to red ball 1", "Action:\ntoggle and go through door", "Action:\ninventory",
           "Thought:\ngo\nAction:\nmove forward", "Action:\nturn left", "Action:\ncraft 4 stick using 2 oak planks"]
OBSERVATIONS = ["You see a door.", "Nothing happens.", "The door opens.", "You see a red ball, a blue key and a door.",
                "Got 1 bone.", "Invalid action.", "You are in a room.", "ok"]


def episode(tok, turns: int, seed: int, max_len: int = 4096) -> Experience:
    rng = random.Random(seed)
    observations = [rng.choice(OBSERVATIONS) for _ in range(turns + 1)]
    actions = [rng.choice(ACTIONS) for _ in range(turns)]
    return to_experience(agent_response(tok, observations, actions), max_len=max_len)


@pytest.fixture(scope="module")
def batch(tok):
    """1, 3 and 20 turns, and 20 turns cut by the context window in the middle of an action (right-padded)."""
    long = episode(tok, 20, seed=3)
    cut_at = turn_spans(long.action_mask, long.sequences.shape[1])[0][15].action_start + 3  # 3 of its tokens kept
    parts = [episode(tok, 1, 0), episode(tok, 3, 1), episode(tok, 20, 2), episode(tok, 20, 3, max_len=cut_at)]
    b = Experience.concat_experiences(parts, pad_token_id=tok.pad_token_id)
    b.index = list(range(4))
    return b


@pytest.fixture(params=["dense_mask", "branch_attention"])
def attention(request):
    """How packed rows reach the model: a dense boolean mask under the model's sdpa, or what ``block_attention``
    picks on a CPU (``branch_attention`` over ``layout_mask``, the actor's path)."""
    return request.param


def packed_attention(model, attention):
    return block_attention(model) if attention == "branch_attention" else contextlib.nullcontext(dense_mask)


def info_gain(logits_fn, b: Experience, max_turns: int, rows_per_forward: int = 2, block_mask=dense_mask):
    """``frozen_signals``' information gain alone (what the actor returns with TE off)."""
    config = CoPEConfig(info_probe_tokens=P, info_max_turns=max_turns, info_kl_batch=rows_per_forward)
    gain, members = frozen_signals(logits_fn, b.sequences, b.attention_mask, b.action_mask, config, True,
                                   block_mask=block_mask)
    assert members is None
    return gain


def te_members(logits_fn, b: Experience, samples, rows_per_forward: int, block_mask=dense_mask):
    """``frozen_signals``' TE members alone, per row of ``b``, from ``samples`` (all rows')."""
    rows = unpadded_trajectories([b])
    gain, members = frozen_signals(logits_fn, b.sequences, b.attention_mask, b.action_mask,
                                   CoPEConfig(te_micro_batch_size_per_gpu=rows_per_forward), False,
                                   [[s for s in samples if s.row == p] for p in b.index], [rows[p] for p in b.index],
                                   block_mask=block_mask)
    assert gain is None
    return members


def left_padded(b: Experience) -> Experience:
    shifts = [int(b.sequences.shape[1] - n) for n in b.attention_mask.sum(-1)]
    roll = lambda t: torch.stack([torch.roll(x, s) for x, s in zip(t, shifts)])  # noqa: E731
    out = Experience(sequences=roll(b.sequences), attention_mask=roll(b.attention_mask),
                     action_mask=roll(b.action_mask))
    out.index = b.index
    return out


def test_mask_rule_hand_case():
    packed = pack_rows([[5, 6, 7, 8], [9]], [[Branch([1, 2], 10, 2), Branch([3], 7, 4)], []], pad_token_id=0)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 1, 2, 3], [9, 0, 0, 0, 0, 0, 0]]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 10, 11, 7] and packed.starts == [[4, 6], []]
    seen = dense_mask(packed)[0, 0].int().tolist()
    assert seen == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],  # branch 1 sees trunk[:2] and itself
        [1, 1, 0, 0, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 1],  # branch 2 sees trunk[:4], not branch 1
    ]
    assert dense_mask(packed)[1, 0, 3].tolist() == [False, True, True, True, False, False, False]  # padding: itself
    add = additive_mask(packed)
    assert torch.equal(add == 0, dense_mask(packed)) and float(add.min()) == torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="trunk has 1 tokens"):
        pack_rows([[9]], [[Branch([1], 0, 2)]])


def test_holes_in_attention_mask_are_refused():
    assert contiguous_span(torch.tensor([0, 1, 1, 0])) == (1, 3)
    with pytest.raises(ValueError, match=r"has holes \(valid tokens 0..3 with 2 masked"):
        contiguous_span(torch.tensor([1, 0, 0, 1]))


@pytest.mark.parametrize("padding", ["right", "left"])
def test_info_gain_equals_per_turn_reference(model, batch, padding, attention):
    b = batch if padding == "right" else left_padded(batch)
    logits_fn = hf_logits_fn(model)
    naive = per_turn_info_gain(logits_fn, b.sequences, b.attention_mask, b.action_mask, P, 20, rows_per_forward=3)
    with packed_attention(model, attention) as build:
        packed = info_gain(logits_fn, b, max_turns=20, rows_per_forward=3, block_mask=build)
    turns = turn_spans(b.action_mask, b.sequences.shape[1], b.attention_mask)
    assert [len(t) for t in turns] == [1, 3, 20, 16]
    assert turns[3][-1].action_end - turns[3][-1].action_start == 3 < P  # the cut turn
    assert naive[2]["cope/info_turns_scored"] == packed[2]["cope/info_turns_scored"] == 2 + 19 + 15
    for row_naive, row_packed in zip(naive[1], packed[1]):
        assert row_packed == pytest.approx(row_naive, abs=1e-5)
    assert torch.allclose(naive[0], packed[0], atol=1e-5)
    assert sum(v > 1e-3 for row in naive[1] for v in row) > 30  # the model does read the observations


def test_info_gain_max_turns_and_block_attention_with_eager(tok, batch):
    """An eager-attention model gets the additive mask from ``block_attention`` and its own implementation back."""
    eager = tiny_model(len(tok), seed=1)
    eager.config._attn_implementation = "eager"
    logits_fn = hf_logits_fn(eager)
    naive = per_turn_info_gain(logits_fn, batch.sequences, batch.attention_mask, batch.action_mask, P, 4)
    with block_attention(eager) as build:
        packed = info_gain(logits_fn, batch, max_turns=4, block_mask=build)
    assert eager.config._attn_implementation == "eager"
    assert naive[2]["cope/info_turns_scored"] == packed[2]["cope/info_turns_scored"] == 2 + 4 + 4
    for row_naive, row_packed in zip(naive[1], packed[1]):
        assert row_packed == pytest.approx(row_naive, abs=1e-5)


def test_block_attention_switches_flash_models_to_branch_attention(model):
    model.config._attn_implementation = "flash_attention_2"  # what OpenRLHF loads on GPUs; no kernel runs here
    try:
        with block_attention(model) as build:
            assert model.config._attn_implementation == BRANCH_ATTENTION  # flex only on CUDA; this machine has none
            packed = pack_rows([[1, 2]], [[Branch([3], 2, 1)]])
            assert torch.equal(build(packed), layout_mask(packed))
        assert model.config._attn_implementation == "flash_attention_2"
    finally:
        model.config._attn_implementation = "sdpa"


def test_branch_attention_equals_dense_mask_with_gradients(tok):
    """Logits and every parameter's gradient, against the dense mask under sdpa: right padding, a branch off the
    empty prefix, a branch off the whole trunk, grouped-query heads (4 query heads on 2 key/value heads)."""
    model = tiny_model(len(tok), seed=3)
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(5, 300) for _ in range(n)]  # noqa: E731
    packed = pack_rows([tokens(60), tokens(45)],
                       [[Branch(tokens(7), 20, 18), Branch(tokens(5), 40, 33), Branch(tokens(1), 0, 0)],
                        [Branch(tokens(9), 45, 45)]], pad_token_id=tok.pad_token_id)
    valid = packed.segment >= 0
    results = []
    for context in (contextlib.nullcontext(dense_mask), block_attention(model)):
        model.zero_grad()
        with context as build:
            logits = model(input_ids=packed.input_ids, attention_mask=build(packed),
                           position_ids=packed.position_ids).logits
            (logits.pow(2).mean(-1) * valid).sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (dense, dense_grads), (runs, runs_grads) = results
    torch.testing.assert_close(runs[valid], dense[valid], atol=1e-5, rtol=0)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(runs_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="layout_mask"):
        q = torch.zeros(1, 2, 3, 4)
        branch_attention(None, q, q, q, dense_mask(pack_rows([[1, 2, 3]], [[]])))


def test_branch_attention_keeps_no_trunk_copies_for_the_backward():
    """Many branches off a long trunk (the joint forecast's layout): the new tensors ``branch_attention`` keeps for
    the backward are about its output's size (output, log-sum-exp) plus one mask of the branch tokens over the row,
    not a copy of the trunk prefix per branch, which made the joint step peak at 1.46x a GRPO step's memory
    (benchmarks/signal_cost.py, 20 turns)."""
    torch.manual_seed(0)
    n, m, heads, kv_heads, dim = 512, 8, 4, 2, 16
    packed = pack_rows([list(range(n))], [[Branch([1] * m, end, end) for end in range(16, n, 16)]])
    width = packed.input_ids.shape[1]
    q = torch.randn(1, heads, width, dim, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, width, dim, requires_grad=True) for _ in range(2))
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out, _ = branch_attention(None, q, k, v, layout_mask(packed))
    mask_shape = (width - n, width)  # the branch tokens over the row: sdpa keeps the boolean mask as floats
    assert sum(t.shape == mask_shape for t in kept) <= 1
    new_bytes = sum(t.numel() * t.element_size() for t in kept if t.is_floating_point() and t.shape != mask_shape
                    and t.untyped_storage().data_ptr() not in inputs)
    assert new_bytes <= 2 * q.numel() * q.element_size(), (new_bytes, q.numel() * q.element_size())
    out.sum().backward()
    assert q.grad is not None and k.grad.abs().sum() > 0


@pytest.mark.slow  # about a minute on 2 CPU cores: flex attention compiles on its first call
@pytest.mark.skipif(not flex_available(), reason="this PyTorch has no flex attention")
def test_flex_block_mask_matches_dense(tok, batch):
    """The flex-attention BlockMask (the GPU path) gives the dense mask's values. Runs on CPU without gradient
    (flex attention has no CPU backward); the CUDA kernel itself could not run on this machine (no GPU)."""
    flex = tiny_model(len(tok))
    flex.config._attn_implementation = "flex_attention"
    two = Experience(sequences=batch.sequences[1:3], attention_mask=batch.attention_mask[1:3],
                     action_mask=batch.action_mask[1:3])
    dense = info_gain(hf_logits_fn(tiny_model(len(tok))), two, max_turns=20)
    packed = info_gain(hf_logits_fn(flex), two, max_turns=20, block_mask=flex_mask)
    for row_dense, row_flex in zip(dense[1], packed[1]):
        assert row_flex == pytest.approx(row_dense, abs=1e-5)


def forecast_samples(tok, batch, layout="list", rows=(0, 1, 2, 3)):
    samples = []
    for row, (tokens, turns) in sorted(unpadded_trajectories([batch]).items()):
        if row not in rows:
            continue
        for s in build_forecast_samples(tokens, turns, tok, k=3, layout=layout, row=row, weight=0.5 + row):
            samples.append(s)
    return samples


def trainable_logits_fn(model):
    return lambda ids, mask, pos, keep: model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                              logits_to_keep=0 if keep is None else keep).logits


@pytest.mark.parametrize("layout,rows", [("list", (0, 1, 2, 3)), ("turns", (1, 3))])
def test_forecast_loss_and_gradients_equal_per_sample_reference(tok, batch, layout, rows, attention):
    model = tiny_model(len(tok), seed=2)
    samples = forecast_samples(tok, batch, layout, rows)
    assert {s.row for s in samples} == set(rows) and len(samples) > 15
    results = []
    for packed in (False, True):
        model.zero_grad()
        if packed:
            with packed_attention(model, attention) as build:
                loss = forecast_loss(trainable_logits_fn(model), samples, coef=0.01, block_mask=build)
                loss.backward()
        else:
            loss = per_sample_forecast_loss(trainable_logits_fn(model), samples, coef=0.01,
                                            pad_token_id=tok.pad_token_id)
            loss.backward()
        results.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (naive, naive_grads), (packed, packed_grads) = results
    assert packed == pytest.approx(naive, abs=1e-5) and naive > 0.01
    for name, grad in naive_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_forecast_gradients_are_the_same_under_gradient_checkpointing(tok, batch, attention, monkeypatch):
    """OpenRLHF's --actor.gradient_checkpointing_enable (a deep model's memory, e.g. SmolLM2's) re-runs each decoder
    layer in the backward pass with the same packed mask: the same loss and gradients as keeping the activations."""
    samples = forecast_samples(tok, batch)
    mlp_runs, results = [], []
    mlp = type(tiny_model(len(tok)).model.layers[0].mlp)
    forward = mlp.forward
    # counted on the class: torch's recomputation bypasses module hooks
    monkeypatch.setattr(mlp, "forward", lambda self, x: mlp_runs.append(1) or forward(self, x))
    for checkpointing in (False, True):
        model = tiny_model(len(tok), seed=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        with packed_attention(model, attention) as build:
            loss = forecast_loss(trainable_logits_fn(model), samples, coef=0.01, block_mask=build)
            forwards = len(mlp_runs)
            loss.backward()
        assert len(mlp_runs) == forwards * (2 if checkpointing else 1)  # recomputed in the backward pass, or not
        mlp_runs.clear()
        results.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (kept, kept_grads), (again, again_grads) = results
    assert again == pytest.approx(kept, abs=1e-6) and kept > 0.01
    for name, grad in kept_grads.items():
        torch.testing.assert_close(again_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_packed_forecast_rows_share_the_trajectory(tok, batch):
    samples = forecast_samples(tok, batch)
    packed = pack_forecast_samples(samples)
    lengths = batch.attention_mask.sum(-1)
    assert packed.rows.input_ids.shape[0] == 4  # one row per trajectory
    for row in range(4):
        branch_tokens = sum(len(s.input_ids) - s.prefix_len for s in samples if s.row == row)
        assert int((packed.rows.segment[row] >= 0).sum()) <= int(lengths[row]) + branch_tokens
    assert len(packed.labels) == sum(sum(s.loss_mask[1:]) for s in samples)
    broken = [s for s in samples if s.row == 2][:2]
    broken[1] = type(broken[1])(**{**broken[1].__dict__, "input_ids": [7] + broken[1].input_ids[1:]})
    with pytest.raises(ValueError, match=r"do not share its tokens \(input_ids\[:prefix_len\]\); give each "
                                         "trajectory its own row number"):
        pack_forecast_samples(broken)


def test_te_members_equal_per_sample_reference(model, tok, batch, attention):
    samples = forecast_samples(tok, batch)
    trajectories = unpadded_trajectories([batch])
    with packed_attention(model, attention) as build:
        members = te_members(hf_logits_fn(model), batch, samples, rows_per_forward=3, block_mask=build)
    covered = 0
    for p, (got, got_metrics) in zip(batch.index, members):
        mine = [s for s in samples if s.row == p]
        # the reference: each sample's full forward, as collect_members was written against
        with torch.no_grad():
            full = [model(input_ids=torch.tensor([s.input_ids])).logits[0] for s in mine]
        targets, probs, ids, counts = collect_members(mine, full, trajectories, top_m=TOP_M)
        assert got["positions"].tolist() == [pos for _, pos in targets]
        assert_same_top_m(got["probs"], got["ids"], probs, ids)
        # counts exact, the members' probability of the taken token up to float noise (as the logits above)
        assert got_metrics == pytest.approx(counts, abs=1e-5)
        covered += len(targets)
        if p == 3:  # the 20-turn trajectory cut by the window: K=3, so turns t-1 and t-2 forecast turn t
            assert te_status(counts)["cope/te_slot_coverage"] > 0.9
    assert covered > 100


def test_packed_paths_run_the_lm_head_only_where_logits_are_read(model, tok, batch):
    """A packed row's full (L, V) logits would not fit a GPU at a real vocabulary: every packed path asks its
    logits_fn for the columns it reads (HF's logits_to_keep), no more."""
    seen = []
    base = hf_logits_fn(model)

    def recording(ids, mask, pos, keep):
        seen.append((ids.shape[1], keep))
        return base(ids, mask, pos, keep)

    with block_attention(model) as build:
        info_gain(recording, batch, max_turns=20, rows_per_forward=1, block_mask=build)
        probes = plan_probes(turn_spans(batch.action_mask, batch.sequences.shape[1], batch.attention_mask), P, 20)
        per_row = [2 * sum(p.positions[1] - p.positions[0] for p in probes if p.row == r) for r in range(4)]
        assert [len(keep) for _, keep in seen] == [n for n in per_row if n]  # real + counterfactual probe columns
        assert all(len(keep) < width for width, keep in seen)

        seen.clear()
        samples = forecast_samples(tok, batch)
        te_members(recording, batch, samples, rows_per_forward=1, block_mask=build)
        assert seen and all(len(keep) < width / 2 for width, keep in seen)

        seen.clear()
        loss = forecast_loss(recording, samples, coef=0.01, block_mask=build)
        # keep holds distinct columns, shared by the rows of the packed batch: at most one per target
        targets = len(pack_forecast_samples(samples).labels)
        assert float(loss) > 0 and len(seen) == 1 and targets * 0.5 < len(seen[0][1]) <= targets < seen[0][0] / 2
