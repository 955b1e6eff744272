"""Temporal ensembling: the forecast-mixture target q, the KL to it, warm-up, and member collection."""

import math

import pytest
import torch

from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import build_forecast_samples
from cope_rlhf.temporal_ensemble import collect_members, locate, mixture_target, te_kl, te_lambda, te_loss
from cope_rlhf.turns import turn_spans
from tests.signal_references import collate_forecast_samples
from tests.tiny_hf import agent_response, tiny_model, tiny_tokenizer, to_experience


def test_mixture_target_hand_computed():
    frozen = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0 + 1e-30], [0.25, 0.25, 0.25, 0.25, 1e-30]]))
    # token 0: two members with top-2 {1: 0.6, 2: 0.2} and {1: 0.5, 4: 0.3}; token 1: no member
    probs = torch.tensor([[[0.6, 0.2], [0.5, 0.3]], [[0.0, 0.0], [0.0, 0.0]]])
    ids = torch.tensor([[[1, 2], [1, 4]], [[0, 0], [0, 0]]])
    valid = torch.tensor([[True, True], [False, False]])
    q = mixture_target(frozen, probs, ids, valid, eta=0.5)
    forecast = torch.tensor([0.0, 0.55, 0.1, 0.0, 0.15])  # mean of members, mass 0.8
    pi = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    expected = (0.5 * pi + 0.5 * forecast) / (0.5 + 0.5 * 0.8)
    assert torch.allclose(q[0], expected, atol=1e-6)
    assert torch.allclose(q[1], torch.softmax(frozen[1], -1))  # no members: q = pi
    assert torch.allclose(q.sum(-1), torch.ones(2))
    assert torch.allclose(mixture_target(frozen, probs, ids, valid, eta=0.0), torch.softmax(frozen, -1))


def test_kl_is_exact_kl_and_zero_at_target():
    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    q = torch.softmax(torch.randn(6, 11), -1)
    p = torch.softmax(logits, -1)
    exact = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(te_kl(logits, q), exact, atol=1e-6)
    assert torch.allclose(te_kl(logits, p), torch.zeros(6), atol=1e-6)
    assert float(te_loss(logits, q, 0.3)) == pytest.approx(0.3 * float(exact.mean()), rel=1e-5)


def test_gradient_step_moves_policy_toward_q():
    torch.manual_seed(1)
    logits = torch.randn(4, 9, requires_grad=True)
    q = torch.softmax(torch.randn(4, 9), -1)
    before = float(te_kl(logits.detach(), q).mean())
    te_loss(logits, q, 1.0).backward()
    with torch.no_grad():
        after = float(te_kl(logits - 0.5 * logits.grad, q).mean())
    assert after < before


def test_lambda_warmup():
    config = CoPEConfig(te_enable=True, te_lambda=0.2, te_warmup_steps=3)
    # global steps count from 1 (the first PPO update), as upstream CoPE's: steps 1 and 2 warm up
    assert [te_lambda(config, s) for s in range(1, 6)] == [0.0, 0.0, 0.2, 0.2, 0.2]
    assert CoPEConfig().te_warmup_steps == 50 and te_lambda(CoPEConfig(te_enable=True, te_lambda=0.2), 49) == 0.0
    assert te_lambda(CoPEConfig(te_lambda=0.2), 10) == 0.0  # TE off


def test_collect_members_from_forecasts():
    tok = tiny_tokenizer()
    obs = ["Go to the red ball.", "You see a door.", "The door opens.", "You see a key.", "Done."]
    acts = ["Action:\nlook around", "Action:\nopen door", "Action:\ntoggle and go through door", "Action:\npick up key"]
    e = to_experience(agent_response(tok, obs, acts))
    tokens = e.sequences[0].tolist()
    turns = turn_spans(e.action_mask, e.sequences.shape[1], e.attention_mask)[0]
    samples = build_forecast_samples(tokens, turns, tok, k=3, row=5)
    input_ids, attention_mask, _, _ = collate_forecast_samples(samples, tok.pad_token_id)
    model = tiny_model(len(tok))
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    targets, probs, ids, valid, metrics = collect_members(
        samples, [logits[i, : len(s.input_ids)] for i, s in enumerate(samples)], {5: (tokens, turns)}, top_m=8
    )
    # forecasts at s=0 cover turns 1, 2; s=1 covers 2, 3; s=2 covers 3: turn 1 has 1 member, turns 2 and 3 have 2
    assert {k: metrics[k] for k in ("cope/te_slots", "cope/te_slot_coverage")} == {"cope/te_slots": 5,
                                                                                 "cope/te_slot_coverage": 1.0}
    by_turn = {}
    for (row, pos), v in zip(targets, valid.sum(-1).tolist()):
        assert row == 5
        turn = next(t for t, span in enumerate(turns) if span.action_start <= pos < span.action_end)
        by_turn.setdefault(turn, set()).add(v)
    assert by_turn == {1: {1}, 2: {2}, 3: {2}}
    # the covered tokens are exactly the realized actions' tokens inside the turns
    for t, text in [(1, "open door"), (3, "pick up key")]:
        at = locate(tokens, turns[t], tok(text, add_special_tokens=False)["input_ids"])
        covered = sorted(pos for _, pos in targets if turns[t].action_start <= pos < turns[t].action_end)
        assert tok.decode(tokens[covered[0] : covered[-1] + 1]) == text and covered[0] == at
    # a member for turn 1 = forecast from s=0: the frozen forecast distribution at its slot tokens
    s0 = samples[0]
    _, start, end = s0.slots[1]
    first = targets.index((5, locate(tokens, turns[1], s0.input_ids[start:end])))
    expected = torch.softmax(logits[0, start - 1], -1).topk(8)
    assert torch.allclose(probs[first, 0], expected.values) and torch.equal(ids[first, 0], expected.indices)
    assert math.isclose(float(probs[first, 0].sum()), float(expected.values.sum()), rel_tol=1e-6)


def test_member_first_token_prob_says_whether_members_foresaw_the_action():
    """``cope/te_member_first_token_prob``: members sure of the taken action's first token give 1, members sure of
    another token ("Thought", as an untrained forecast's are) give 0; later tokens of the slot do not count."""
    tok = tiny_tokenizer()
    obs = ["Go to the red ball.", "You see a door.", "The door opens.", "Done."]
    acts = ["Action:\nlook around", "Action:\nopen door", "Action:\npick up key"]
    e = to_experience(agent_response(tok, obs, acts))
    tokens = e.sequences[0].tolist()
    turns = turn_spans(e.action_mask, e.sequences.shape[1], e.attention_mask)[0]
    samples = build_forecast_samples(tokens, turns, tok, k=3, row=0)
    wrong = tok("Thought", add_special_tokens=False)["input_ids"][0]

    def forecasts(first_token_of):
        """Logits certain of ``first_token_of(realized first token)`` at each later slot's first token."""
        out = []
        for s in samples:
            logits = torch.zeros(len(s.input_ids), len(tok))
            for t, start, _ in s.slots:
                if t > s.turn:
                    logits[start - 1, first_token_of(s.input_ids[start])] = 50.0
            out.append(logits)
        return out

    hit = collect_members(samples, forecasts(lambda real: real), {0: (tokens, turns)}, top_m=8)[-1]
    miss = collect_members(samples, forecasts(lambda real: wrong), {0: (tokens, turns)}, top_m=8)[-1]
    assert hit["cope/te_slots"] == 3 and hit["cope/te_slot_coverage"] == 1.0
    assert hit["cope/te_member_first_token_prob"] == pytest.approx(1.0, abs=1e-6)
    assert miss["cope/te_member_first_token_prob"] == pytest.approx(0.0, abs=1e-6)


def test_te_repeated_with_q_from_the_current_policy_hands_the_token_to_the_members():
    """docs/METHOD.md "What TE converges to": q is re-mixed from the (detached) current policy at every step, so
    repeated TE steps carry the policy to the members' distribution, not to a blend of the two."""
    vocab = 6
    policy = torch.log(torch.tensor([[0.90, 0.04, 0.02, 0.02, 0.01, 0.01]])).requires_grad_(True)
    forecast = torch.tensor([0.05, 0.70, 0.10, 0.05, 0.05, 0.05])  # the members expect token 1; the policy says 0
    probs, ids = forecast.sort(descending=True)
    member_probs, member_ids, valid = probs.view(1, 1, vocab), ids.view(1, 1, vocab), torch.ones(1, 1, dtype=torch.bool)
    optimizer = torch.optim.SGD([policy], lr=2.0)
    for _ in range(400):
        q = mixture_target(policy.detach(), member_probs, member_ids, valid, eta=0.5)
        optimizer.zero_grad()
        te_loss(policy, q, 1.0).backward()
        optimizer.step()
    final = torch.softmax(policy.detach(), -1)[0]
    assert torch.allclose(final, forecast, atol=0.02)
    assert int(final.argmax()) == 1
