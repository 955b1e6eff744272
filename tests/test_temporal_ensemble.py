"""Temporal ensembling: the forecast-mixture target q, the KL to it, warm-up, and member collection."""

import math

import pytest
import torch

from cope_rlhf.config import CoPEConfig
from cope_rlhf.forecast import build_forecast_samples
from cope_rlhf.forecast import ReActFormat, rejected_turns
from cope_rlhf import temporal_ensemble
from cope_rlhf.forecast import ForecastSample
from cope_rlhf.temporal_ensemble import (MAX_SLOT_TOKENS, collect_members, later_forecasts, locate, member_requests,
                                         mixture_target, mixture_top_m, te_kl, te_lambda, te_status, trajectory_means)
from cope_rlhf.turns import Turn, turn_spans
from cope_rlhf.signal_references import collate_forecast_samples
from tests.tiny_hf import agent_response, tiny_model, tiny_tokenizer, to_experience


def trajectory(tok, observations, actions):
    """One episode as OpenRLHF's executor returns it: (its token ids, its turns)."""
    e = to_experience(agent_response(tok, observations, actions))
    return e.sequences[0].tolist(), turn_spans(e.action_mask, e.sequences.shape[1], e.attention_mask)[0]


def test_mixture_target_hand_computed():
    frozen = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0 + 1e-30], [0.2, 0.2, 0.2, 0.2, 0.2]]))
    # row 0: q^F's top-2 {1: 0.55, 4: 0.15}, mass 0.7; row 1: {0: 0.9, 3: 0.05}, mass 0.95 (each row its own Z)
    forecast_probs, forecast_ids = torch.tensor([[0.55, 0.15], [0.9, 0.05]]), torch.tensor([[1, 4], [0, 3]])
    q = mixture_target(frozen, forecast_probs, forecast_ids, eta=0.5)
    pi = torch.softmax(frozen, -1)
    forecast = torch.tensor([[0.0, 0.55, 0.0, 0.0, 0.15], [0.9, 0.0, 0.0, 0.05, 0.0]])
    expected = (0.5 * pi + 0.5 * forecast) / (0.5 + 0.5 * torch.tensor([[0.7], [0.95]]))
    assert torch.allclose(q, expected, atol=1e-6)
    assert torch.allclose(q.sum(-1), torch.ones(2))
    assert torch.allclose(mixture_target(frozen, forecast_probs, forecast_ids, eta=0.0), pi)


def test_locate_finds_the_last_match_inside_the_action_only():
    """A slot covers the trajectory where its tokens occur inside the turn's action tokens, the last occurrence; not
    in the feedback after it, not straddling the token before it; -1 when nowhere."""
    tokens = [9, 1, 2, 3, 1, 2, 8, 1, 2]
    turn = Turn(obs_start=0, obs_end=1, action_start=1, action_end=6, next_obs_end=9)
    assert locate(tokens, turn, [1, 2]) == 4  # not 1 (not the last), not 7 (the feedback)
    assert locate(tokens, turn, [1, 2, 3]) == 1  # the action's first token
    assert locate(tokens, turn, [9, 1]) == -1  # starts before the action
    assert locate(tokens, turn, [7]) == -1


def test_te_status_of_nothing_is_zero():
    assert set(te_status(dict.fromkeys(temporal_ensemble.COUNTS, 0.0)).values()) == {0.0}


def test_later_forecasts_keep_the_slots_of_later_turns_only():
    """Members are forecasts of a later turn: a sample whose only slot is its own turn is left out; the others are
    cut from the column before their first later slot to the end of their last one, slots shifted to the cut, and
    each trajectory's request reads exactly those columns (branches end at the cut)."""
    only_now = ForecastSample(list(range(10)), [0] * 10, row=0, turn=2, slots=[(2, 6, 8)], prefix_len=4)
    ahead = ForecastSample(list(range(20)), [0] * 20, row=0, turn=1, slots=[(1, 8, 10), (2, 11, 13), (3, 14, 16)],
                           prefix_len=4)
    kept, cuts, trimmed = later_forecasts([only_now, ahead])
    assert kept == [ahead] and cuts == [(10, 16)]
    assert trimmed[0].input_ids == list(range(10, 16)) and trimmed[0].slots == [(2, 1, 3), (3, 4, 6)]
    (request,) = member_requests(kept, cuts)
    assert [len(branch.tokens) for branch in request.branches] == [16 - 4]


def test_forecast_mixture_is_cut_to_its_own_top_m():
    """Upstream's q^F: the members' top-M distributions averaged, then cut back to the top-M of the average. Two
    members with top-2 {1: 0.6, 2: 0.2} and {1: 0.5, 4: 0.3} average to {1: 0.55, 2: 0.1, 4: 0.15}: token 2 leaves.
    (Keeping the union of the members' top-M, as this project did before, kept token 2 and changed the gradient.)"""
    probs, ids = mixture_top_m([(torch.tensor([0.6, 0.2]), torch.tensor([1, 2])),
                                (torch.tensor([0.5, 0.3]), torch.tensor([1, 4]))], top_m=2)
    assert ids.tolist() == [1, 4] and torch.allclose(probs, torch.tensor([0.55, 0.15]))
    one = mixture_top_m([(torch.tensor([0.6, 0.2]), torch.tensor([1, 2]))], top_m=2)
    assert one[1].tolist() == [1, 2] and torch.allclose(one[0], torch.tensor([0.6, 0.2]))


def test_kl_is_exact_kl_and_zero_at_target():
    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    q = torch.softmax(torch.randn(6, 11), -1)
    p = torch.softmax(logits, -1)
    exact = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(te_kl(logits, q), exact, atol=1e-6)
    assert torch.allclose(te_kl(logits, p), torch.zeros(6), atol=1e-6)


def test_gradient_step_moves_policy_toward_q():
    torch.manual_seed(1)
    logits = torch.randn(4, 9, requires_grad=True)
    q = torch.softmax(torch.randn(4, 9), -1)
    before = float(te_kl(logits.detach(), q).mean())
    te_kl(logits, q).mean().backward()
    with torch.no_grad():
        after = float(te_kl(logits - 0.5 * logits.grad, q).mean())
    assert after < before


def test_trajectory_means_weigh_every_trajectory_alike():
    """Upstream's scale: a trajectory's covered tokens are averaged first, so a trajectory with 3 covered tokens
    weighs as much as one with 1 (a token mean over the batch would give it 3/4 of the weight); a trajectory with
    none gets 0 and still counts where the caller divides by the trajectories."""
    token_kl = torch.tensor([1.0, 2.0, 6.0, 10.0])
    means = trajectory_means(token_kl, torch.tensor([0, 0, 0, 2]), 3)
    assert means.tolist() == [3.0, 0.0, 10.0]
    assert float(means.mean()) == pytest.approx(13 / 3) and float(token_kl.mean()) == pytest.approx(19 / 4)


def test_lambda_warmup_and_hold():
    config = CoPEConfig(te_enable=True, te_lambda=0.2, te_warmup_steps=3)
    # global steps count from 1 (the first PPO update), as upstream CoPE's: steps 1 and 2 warm up
    assert [te_lambda(config, s) for s in range(1, 6)] == [0.0, 0.0, 0.2, 0.2, 0.2]
    assert CoPEConfig().te_warmup_steps == 50 and te_lambda(CoPEConfig(te_enable=True, te_lambda=0.2), 49) == 0.0
    assert te_lambda(CoPEConfig(te_lambda=0.2), 10) == 0.0  # TE off
    assert te_lambda(config, 5, held=True) == 0.0


def test_skip_invalid_is_on_by_default_as_upstream():
    assert CoPEConfig().action_forecast_skip_invalid is True


def test_collect_members_from_forecasts():
    tok = tiny_tokenizer()
    obs = ["Go to the red ball.", "You see a door.", "The door opens.", "You see a key.", "Done."]
    acts = ["Action:\nlook around", "Action:\nopen door", "Action:\ntoggle and go through door", "Action:\npick up key"]
    tokens, turns = trajectory(tok, obs, acts)
    samples = build_forecast_samples(tokens, turns, tok, k=3, row=5)
    input_ids, attention_mask, _, _ = collate_forecast_samples(samples, tok.pad_token_id)
    model = tiny_model(len(tok))
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    targets, probs, ids, counts = collect_members(
        samples, [logits[i, : len(s.input_ids)] for i, s in enumerate(samples)], {5: (tokens, turns)}, top_m=8
    )
    metrics = te_status(counts)
    # forecasts at s=0 cover turns 1, 2; s=1 covers 2, 3; s=2 covers 3: turn 1 has 1 member, turns 2 and 3 have 2
    assert {k: metrics[k] for k in ("cope/te_slots", "cope/te_slot_coverage")} == {"cope/te_slots": 5,
                                                                                 "cope/te_slot_coverage": 1.0}
    assert {row for row, _ in targets} == {5}
    covered_turns = {next(t for t, span in enumerate(turns) if span.action_start <= pos < span.action_end)
                     for _, pos in targets}
    assert covered_turns == {1, 2, 3}
    # the covered tokens are exactly the realized actions' tokens inside the turns
    for t, text in [(1, "open door"), (3, "pick up key")]:
        at = locate(tokens, turns[t], tok(text, add_special_tokens=False)["input_ids"])
        covered = sorted(pos for _, pos in targets if turns[t].action_start <= pos < turns[t].action_end)
        assert tok.decode(tokens[covered[0] : covered[-1] + 1]) == text and covered[0] == at
    # turn 1's one member, the forecast from s=0: its frozen distribution's top-M at the slot's first token
    s0, s1 = samples[0], samples[1]
    _, start, end = s0.slots[1]
    first = targets.index((5, locate(tokens, turns[1], s0.input_ids[start:end])))
    expected = torch.softmax(logits[0, start - 1], -1).topk(8)
    assert torch.allclose(probs[first], expected.values) and torch.equal(ids[first], expected.indices)
    # turn 2's two members (from s=0 and s=1): the top-M of their top-M distributions' mean
    (_, a, _), (_, b, _) = s0.slots[2], s1.slots[1]
    second = targets.index((5, locate(tokens, turns[2], s0.input_ids[a:s0.slots[2][2]])))
    members = [torch.softmax(logits[i, at - 1], -1).topk(8) for i, at in ((0, a), (1, b))]
    mean = torch.zeros(len(tok))
    for m in members:
        mean[m.indices] += m.values / 2
    want = mean.topk(8)
    assert torch.allclose(probs[second], want.values, atol=1e-6) and torch.equal(ids[second], want.indices)
    assert math.isclose(float(probs[second].sum()), float(want.values.sum()), rel_tol=1e-6)


@pytest.mark.parametrize("extra", [0, 4])
def test_a_slot_longer_than_sixteen_tokens_is_no_member(extra):
    """Upstream drops a slot of more than ``MAX_SLOT_TOKENS`` tokens (it used to cover its first 16 here); a slot of
    exactly 16 is a member."""
    tok = tiny_tokenizer()
    words = ["go"] * 40
    while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) > MAX_SLOT_TOKENS + extra:
        words.pop()
    action = " ".join(words)
    assert len(tok(action, add_special_tokens=False)["input_ids"]) == MAX_SLOT_TOKENS + extra
    obs = ["Go to the red ball.", "You see a door.", "The door opens.", "Done."]
    acts = ["Action:\nlook around", f"Action:\n{action}", "Action:\nopen door"]
    tokens, turns = trajectory(tok, obs, acts)
    samples = build_forecast_samples(tokens, turns, tok, k=3, row=0)
    logits = [torch.zeros(len(s.input_ids), len(tok)) for s in samples]
    targets, _, _, counts = collect_members(samples, logits, {0: (tokens, turns)}, top_m=8)
    in_turn_1 = [pos for _, pos in targets if turns[1].action_start <= pos < turns[1].action_end]
    assert len(in_turn_1) == (0 if extra else MAX_SLOT_TOKENS)
    assert any(turns[2].action_start <= pos < turns[2].action_end for _, pos in targets)
    assert counts["slots"] == 3 and counts["covered"] == (2 if extra else 3)  # turn 1's slot (from s=0)


def test_at_most_so_many_covered_tokens_per_trajectory(monkeypatch):
    """``MAX_COVERED_PER_TRAJECTORY`` tokens of a trajectory get members, the first ones met (upstream's cap of 128,
    set to 3 here)."""
    tok = tiny_tokenizer()
    obs = ["Go to the red ball.", "You see a door.", "The door opens.", "You see a key.", "Done."]
    acts = ["Action:\nlook around", "Action:\nopen door", "Action:\ntoggle and go through door",
            "Action:\npick up key"]
    tokens, turns = trajectory(tok, obs, acts)
    samples = build_forecast_samples(tokens, turns, tok, k=3, row=0)
    logits = [torch.zeros(len(s.input_ids), len(tok)) for s in samples]
    uncapped = collect_members(samples, logits, {0: (tokens, turns)}, top_m=8)[0]
    monkeypatch.setattr(temporal_ensemble, "MAX_COVERED_PER_TRAJECTORY", 3)
    targets, probs, ids, _ = collect_members(samples, logits, {0: (tokens, turns)}, top_m=8)
    # forecasts are met turn after turn, so the first tokens met are the earliest covered ones
    assert len(uncapped) > 3 and targets == sorted(uncapped)[:3]
    assert ids.dtype == torch.long and torch.isfinite(mixture_target(torch.zeros(3, len(tok)), probs, ids, 0.5)).all()


def test_member_metrics_on_valid_actions_and_rejected_targets():
    """``cope/te_member_prob_valid`` reads only slots whose action the env accepted; ``cope/te_invalid_target_frac``
    counts member slots whose action it rejected, 0 once skip-invalid leaves them out."""
    tok = tiny_tokenizer()
    obs = ["Go to the red ball.", "You see a door.", "Invalid action: no such thing.", "The door opens.", "Done."]
    acts = ["Action:\nlook around", "Action:\nfly away", "Action:\nopen door", "Action:\npick up key"]
    tokens, turns = trajectory(tok, obs, acts)
    rejected = rejected_turns(tokens, turns, tok, ReActFormat())
    assert rejected == [False, True, False, False]

    def counts(skip_invalid, right_on_invalid):
        samples = build_forecast_samples(tokens, turns, tok, k=3, row=0, skip_invalid=skip_invalid)
        logits = []
        for s in samples:  # members certain of the first token of every later action, except the rejected one's
            out = torch.zeros(len(s.input_ids), len(tok))
            for t, start, _ in s.slots:
                if t > s.turn:
                    out[start - 1, s.input_ids[start] if right_on_invalid or not rejected[t] else 0] = 50.0
            logits.append(out)
        return te_status(collect_members(samples, logits, {0: (tokens, turns)}, {0: rejected}, top_m=8)[-1])

    raw = counts(skip_invalid=False, right_on_invalid=False)
    assert raw["cope/te_invalid_target_frac"] == pytest.approx(1 / 5)  # slots: s0 -> 1, 2; s1 -> 2, 3; s2 -> 3
    assert raw["cope/te_member_prob_valid"] == pytest.approx(1.0, abs=1e-6)
    assert raw["cope/te_member_first_token_prob"] == pytest.approx(4 / 5, abs=1e-6)
    clean = counts(skip_invalid=True, right_on_invalid=False)
    assert clean["cope/te_invalid_target_frac"] == 0.0 and clean["cope/te_member_prob_valid"] == pytest.approx(1.0)


def test_member_first_token_prob_says_whether_members_foresaw_the_action():
    """``cope/te_member_first_token_prob``: members sure of the taken action's first token give 1, members sure of
    another token ("Thought", as an untrained forecast's are) give 0; later tokens of the slot do not count."""
    tok = tiny_tokenizer()
    obs = ["Go to the red ball.", "You see a door.", "The door opens.", "Done."]
    acts = ["Action:\nlook around", "Action:\nopen door", "Action:\npick up key"]
    tokens, turns = trajectory(tok, obs, acts)
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

    hit = te_status(collect_members(samples, forecasts(lambda real: real), {0: (tokens, turns)}, top_m=8)[-1])
    miss = te_status(collect_members(samples, forecasts(lambda real: wrong), {0: (tokens, turns)}, top_m=8)[-1])
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
    optimizer = torch.optim.SGD([policy], lr=2.0)
    for _ in range(400):
        q = mixture_target(policy.detach(), probs.view(1, vocab), ids.view(1, vocab), eta=0.5)
        optimizer.zero_grad()
        te_kl(policy, q).mean().backward()
        optimizer.step()
    final = torch.softmax(policy.detach(), -1)[0]
    assert torch.allclose(final, forecast, atol=0.02)
    assert int(final.argmax()) == 1
