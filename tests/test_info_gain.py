"""Information gain (``frozen_signals``, the trainer's packed path) against a naive reference that deletes each
observation from the sequence, one turn at a time, on a small real HF causal LM (random init), with OpenRLHF-built,
right-padded Experiences."""

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience

from cope_rlhf.config import CoPEConfig
from cope_rlhf.frozen_signals import frozen_signals
from cope_rlhf.info_gain import plan_probes, position_ids_for
from cope_rlhf.turns import turn_spans
from tests.tiny_hf import agent_response, hf_logits_fn, to_experience

P = 4


def info_gain_rewards(logits_fn, sequences, attention_mask, action_mask, max_turns=8, rows_per_forward=2):
    """(token rewards, r_t per turn, metrics): ``frozen_signals`` with information gain alone."""
    config = CoPEConfig(info_probe_tokens=P, info_max_turns=max_turns, info_kl_batch=rows_per_forward)
    return frozen_signals(logits_fn, sequences, attention_mask, action_mask, config, info_gain=True)[0]


@pytest.fixture(scope="module")
def batch(tok):
    episodes = [
        (["You are in a room. Go to the red ball.", "You see a door.", "Nothing happens.", "The door opens."],
         ["Thought:\nlook.\n\nAction:\nlook around", "Action:\nopen door", "Action:\ntoggle and go through door"]),
        (["Craft a stick.", "Got 1 bone."], ["Action:\nget 1 bone"]),
        (["Pick up the key.", "You see a key.", "Invalid action.", "You see a blue key.", "Done."],
         ["Action:\nlook around", "Action:\npick key", "Action:\nlook around", "Action:\npick up key"]),
    ]
    return Experience.concat_experiences(
        [to_experience(agent_response(tok, obs, acts)) for obs, acts in episodes], pad_token_id=tok.pad_token_id
    )


def naive_info_gain(model, batch, probe_tokens):
    """For each turn t >= 1: delete the feedback tokens before turn t (all but the last one, whose output
    predicts the first action token) from the row, keep the survivors' original positions, run the row alone,
    and average KL(real || deleted) over the first `probe_tokens` action tokens."""
    values = {}
    for row, turns in enumerate(turn_spans(batch.action_mask, batch.sequences.shape[1], batch.attention_mask)):
        length = int(batch.attention_mask[row].sum())
        ids = batch.sequences[row, :length]
        positions = torch.arange(length)
        with torch.no_grad():
            real = model(input_ids=ids[None], position_ids=positions[None]).logits[0]
        for t in range(1, len(turns)):
            turn = turns[t]
            keep = torch.ones(length, dtype=torch.bool)
            keep[turn.obs_start : turn.obs_end - 1] = False
            with torch.no_grad():
                cut = model(input_ids=ids[keep][None], position_ids=positions[keep][None]).logits[0]
            kls = []
            for j in range(min(probe_tokens, turn.action_end - turn.action_start)):
                pos = turn.action_start - 1 + j
                cut_pos = int(keep[:pos].sum())  # index of `pos` among the kept tokens
                p, q = torch.log_softmax(real[pos], -1), torch.log_softmax(cut[cut_pos], -1)
                kls.append(float((p.exp() * (p - q)).sum()))
            values[(row, t)] = sum(kls) / len(kls)
    return values


def test_matches_naive_deletion_reference(model, batch):
    token_rewards, turn_rewards, metrics = info_gain_rewards(
        hf_logits_fn(model), batch.sequences, batch.attention_mask, batch.action_mask, max_turns=8, rows_per_forward=2
    )
    reference = naive_info_gain(model, batch, P)
    assert len(reference) == 5 and metrics["cope/info_turns_scored"] == 5
    for (row, t), value in reference.items():
        assert abs(turn_rewards[row][t] - value) < 1e-5, (row, t, turn_rewards[row][t], value)
        assert value > 1e-4  # the random model does read the observations
    assert all(r[0] == 0.0 for r in turn_rewards)  # first turn follows the prompt: no counterfactual
    assert abs(metrics["cope/info_reward_mean"] - sum(reference.values()) / 5) < 1e-5


def test_written_on_every_turn_token_and_nothing_elsewhere(model, batch):
    token_rewards, turn_rewards, _ = info_gain_rewards(
        hf_logits_fn(model), batch.sequences, batch.attention_mask, batch.action_mask
    )
    assert token_rewards.shape == batch.action_mask.shape
    assert not token_rewards[batch.action_mask == 0].any()
    turns = turn_spans(batch.action_mask, batch.sequences.shape[1], batch.attention_mask)
    for row, row_turns in enumerate(turns):
        for t, turn in enumerate(row_turns):
            span = token_rewards[row, turn.action_start - 1 : turn.action_end - 1]
            # r_t on every token of the turn (upstream CoPE), not r_t / len: no bias toward short turns
            assert torch.equal(span, torch.full_like(span, turn_rewards[row][t]))


def test_only_last_max_turns_are_scored(model, batch):
    _, turn_rewards, metrics = info_gain_rewards(
        hf_logits_fn(model), batch.sequences, batch.attention_mask, batch.action_mask, max_turns=1
    )
    assert metrics["cope/info_turns_scored"] == 2  # row 1 has a single turn: nothing to score
    assert turn_rewards[0][:2] == [0.0, 0.0] and turn_rewards[0][2] > 0
    assert turn_rewards[2][:3] == [0.0, 0.0, 0.0] and turn_rewards[2][3] > 0
    probes = plan_probes(turn_spans(batch.action_mask, batch.sequences.shape[1], batch.attention_mask), P, 2)
    assert [(p.row, p.turn) for p in probes] == [(0, 1), (0, 2), (2, 2), (2, 3)]


def test_zero_when_the_model_ignores_observations(tok, batch):
    """Stand-in model (a fake, on purpose): a bigram table, whose next-token distribution depends on the
    current token only, so masking an observation cannot change it."""
    torch.manual_seed(0)
    table = torch.randn(len(tok), len(tok))

    def bigram(sequences, attention_mask, position_ids, keep):
        return table[sequences if keep is None else sequences[:, keep]]

    token_rewards, turn_rewards, metrics = info_gain_rewards(
        bigram, batch.sequences, batch.attention_mask, batch.action_mask
    )
    assert metrics["cope/info_turns_scored"] == 5
    assert not token_rewards.any() and all(v == 0.0 for r in turn_rewards for v in r)


def test_positions_are_openrlhf_positions():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert position_ids_for(mask).tolist() == [[0, 1, 2, 1], [1, 0, 1, 2]]


def test_left_padding_gives_the_same_values(model, batch):
    logits_fn = hf_logits_fn(model)
    _, right, _ = info_gain_rewards(logits_fn, batch.sequences, batch.attention_mask, batch.action_mask)
    shifts = [int(batch.sequences.shape[1] - n) for n in batch.attention_mask.sum(-1)]
    to_left = lambda t: torch.stack([torch.roll(x, s) for x, s in zip(t, shifts)])  # noqa: E731
    _, left, _ = info_gain_rewards(
        logits_fn, to_left(batch.sequences), to_left(batch.attention_mask), to_left(batch.action_mask)
    )
    assert any(shifts) and len(sum(right, [])) == 8
    for a, b in zip(right, left):
        assert a == pytest.approx(b, abs=1e-5)


def test_single_turn_episodes_score_nothing_and_say_so(model, tok):
    """Episodes of one turn have no feedback before an action: every token reward is 0 and the metrics say no turn
    was scored (the values the log keeps for such a batch)."""
    e = to_experience(agent_response(tok, ["Craft a stick.", "Got 1 bone."], ["Action:\nget 1 bone"]))
    tokens, rewards, metrics = info_gain_rewards(hf_logits_fn(model), e.sequences, e.attention_mask, e.action_mask)
    assert not tokens.any() and tokens.dtype == torch.float32
    assert metrics == {"cope/info_reward_mean": 0.0, "cope/info_turns_scored": 0}


def test_each_trajectory_runs_only_up_to_its_last_probe(batch):
    """The packed row of a trajectory holds its tokens up to the last probed one (later tokens cannot change the
    logits read, so running them would only cost)."""
    from cope_rlhf.info_gain import probe_requests

    turns = turn_spans(batch.action_mask, batch.sequences.shape[1], batch.attention_mask)
    probes = plan_probes(turns, P, max_turns=8)
    rows, requests = probe_requests(batch.sequences, batch.attention_mask, probes)
    for mine, request in zip(rows, requests):
        assert len(request.trunk) == max(p.positions[1] for p in mine) < int(batch.attention_mask[mine[0].row].sum())
