"""Action forecast: realized actions, invalid detection, samples in both layouts, gate, weights, NLL."""

import copy

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience

from cope_rlhf.config import CoPEConfig
from agent_funcs.alfworld import ALFWorldAgent
from cope_rlhf.forecast import (
    PLAN_AHEAD as PLAN,
    PLAN_AHEAD_TURNS as PLAN_TURNS,
    ForecastSample,
    ReActFormat,
    build_forecast_samples,
    forecast_loss,
    forecast_weights,
    kept_logit_columns,
    load_action_format,
    pack_forecast_samples,
    packed_forecast_nll,
    rejected_turns,
    trajectory_gate,
)
from cope_rlhf.turns import turn_spans, unpadded_trajectories
from cope_rlhf.signal_references import forecast_samples_from_experiences, group_norm_weights
from tests.tiny_hf import agent_response, tiny_model, to_experience

OBS = ["Go to the red ball.", "You see a door.", "Nothing happens.", "The door opens.", "Done."]
ACTS = ["Thought:\nlook.\n\nAction:\nlook around", "Action:\nopen door", "Action:\ntoggle and go through door",
        "Thought: go\nAction:\n\npick up key\nextra words"]
@pytest.fixture(scope="module")
def episode(tok):
    e = to_experience(agent_response(tok, OBS, ACTS))
    return e.sequences[0].tolist(), turn_spans(e.action_mask, e.sequences.shape[1], e.attention_mask)[0]


def test_plan_ahead_wording():
    assert PLAN.format(k=3) == ("Plan ahead: list the next 3 actions you will take to make progress on the task, "
                                "starting with the action you take right now, one action per line.")


def test_react_format_for_agent_funcs_that_declare_none():
    realized_action = ReActFormat.realized_action
    assert realized_action("Thought:\nI think.\n\nAction:\ngo north\nmore") == "go north"
    assert realized_action("Action: go north") == "go north"  # same line
    assert realized_action("Action:\nfirst\nThought: no\nAction:\n\n  second  ") == "second"  # the last Action:
    assert realized_action("just text\n\nlast line \n") == "last line"  # no Action: -> last non-empty line
    assert realized_action("Action:\n\n") == "" and realized_action("") == ""
    assert ReActFormat.is_invalid("Invalid Action. Try again.") and not ReActFormat.is_invalid("You open the door.")


def test_action_format_is_read_from_the_agent_func(tmp_path):
    assert load_action_format("agent_funcs/alfworld.py").is_invalid("Nothing happens.")
    assert not load_action_format("agent_funcs/babyai.py").is_invalid("Nothing happens.")
    plain = tmp_path / "plain_agent.py"
    plain.write_text("class AgentExecutor:\n    pass\n")
    assert isinstance(load_action_format(str(plain)), ReActFormat)
    assert isinstance(load_action_format(None), ReActFormat)
    with pytest.raises(FileNotFoundError, match="agent_func_path"):
        load_action_format(str(tmp_path / "missing.py"))


def test_list_layout_reads_as_designed(tok, episode):
    tokens, turns = episode
    samples = build_forecast_samples(tokens, turns, tok, k=3, layout="list")
    assert [s.turn for s in samples] == [0, 1, 2, 3]
    assert {(s.row, s.weight) for s in samples} == {(0, 1.0)}  # one trajectory's samples: row 0, weight 1
    second = samples[1]
    text = tok.decode(second.input_ids)
    prefix = tok.decode(tokens[: turns[1].action_start])
    # the prefix ends at observation 1 (the trailing assistant header is replaced by the plan-ahead message)
    assert text.startswith(prefix[: -len("<|im_start|>assistant\n")])
    assert text[len(prefix) - len("<|im_start|>assistant\n"):] == (
        f"<|im_start|>user\n{PLAN.format(k=3)}<|im_end|>\n<|im_start|>assistant\n"
        "open door\ntoggle and go through door\npick up key<|im_end|>\n"
    )
    header = len(tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    assert second.prefix_len == turns[1].action_start - header
    assert second.input_ids[: second.prefix_len] == tokens[: second.prefix_len]  # trajectory tokens reused as is
    assert set(second.loss_mask) == {0, 1}
    target = tok.decode([i for i, m in zip(second.input_ids, second.loss_mask) if m])
    assert target == "open door\ntoggle and go through door\npick up key<|im_end|>\n"
    assert [tok.decode(second.input_ids[a:b]) for _, a, b in second.slots] == [
        "open door", "toggle and go through door", "pick up key"]
    assert [t for t, _, _ in second.slots] == [1, 2, 3]
    # k = min(K, actions left)
    last = f"{PLAN.format(k=1)}<|im_end|>\n<|im_start|>assistant\npick up key<|im_end|>\n"
    assert tok.decode(samples[3].input_ids).endswith(last)


def test_turns_layout_and_skip_invalid(tok, episode):
    """K-turn windows with the invalid actions dropped (ALFWorld's "Nothing happens." follows "open door")."""
    tokens, turns = episode
    samples = build_forecast_samples(tokens, turns, tok, k=2, layout="turns", skip_invalid=True,
                                     action_format=ALFWorldAgent)
    assert [s.turn for s in samples] == [0, 1, 2, 3]  # every turn issues one, the invalid one too
    assert [[t for t, _, _ in s.slots] for s in samples] == [[0], [2], [2, 3], [3]]  # "open door" is in no window
    third = samples[2]
    assert tok.decode(third.input_ids).endswith(
        f"<|im_start|>user\n{PLAN_TURNS.format(k=2)}<|im_end|>\n<|im_start|>assistant\ntoggle and go through door"
        "<|im_end|>\n<|im_start|>user\nNext action?<|im_end|>\n<|im_start|>assistant\npick up key<|im_end|>\n"
    )
    assert set(third.loss_mask) == {0, 1}
    target = tok.decode([i for i, m in zip(third.input_ids, third.loss_mask) if m])
    assert target == "toggle and go through door<|im_end|>\npick up key<|im_end|>\n"
    # a turn whose whole window was rejected issues no sample; the turns after it still do
    assert [s.turn for s in build_forecast_samples(tokens, turns, tok, k=1, layout="turns", skip_invalid=True,
                                                   action_format=ALFWorldAgent)] == [0, 2, 3]
    # without skip-invalid the failed action stays a target
    assert [[t for t, _, _ in s.slots] for s in build_forecast_samples(
        tokens, turns, tok, k=2, layout="turns", action_format=ALFWorldAgent)] == [[0, 1], [1, 2], [2, 3], [3]]


def test_a_reply_opening_of_the_chat_template_is_part_of_the_target(tok, episode):
    """Where the template opens each assistant message with text of its own after the generation prompt (here an
    empty think block, as reasoning models' templates do), the forecast's reply opens with it too, and it is a
    target: the policy would write it first."""
    tokens, turns = episode
    thinking = copy.deepcopy(tok)
    think = "{% if m['role'] == 'assistant' %}<think>\n\n</think>\n\n{% endif %}"
    thinking.chat_template = tok.chat_template.replace("\n{{ m['content'] }}", "\n" + think + "{{ m['content'] }}")
    for layout, expected in (("list", "<think>\n\n</think>\n\nopen door\ntoggle and go through door<|im_end|>\n"),
                             ("turns", "<think>\n\n</think>\n\nopen door<|im_end|>\n<think>\n\n</think>\n\n"
                                       "toggle and go through door<|im_end|>\n")):
        second = build_forecast_samples(tokens, turns, thinking, k=2, layout=layout)[1]
        assert set(second.loss_mask) == {0, 1}
        assert tok.decode([i for i, m in zip(second.input_ids, second.loss_mask) if m]) == expected
        assert [tok.decode(second.input_ids[a:b]) for _, a, b in second.slots] == ["open door",
                                                                                   "toggle and go through door"]


def test_long_prefix_is_left_truncated(tok, episode):
    tokens, turns = episode
    full = build_forecast_samples(tokens, turns, tok, k=2)
    cut = build_forecast_samples(tokens, turns, tok, k=2, max_length=len(full[2].input_ids) - 5)
    assert [len(s.input_ids) for s in cut[:2]] == [len(s.input_ids) for s in full[:2]]  # short enough: unchanged
    assert cut[2].input_ids == full[2].input_ids[5:] and cut[2].loss_mask == full[2].loss_mask[5:]
    assert cut[2].prefix_len == 0  # shares no positions with its trajectory any more
    one_over = build_forecast_samples(tokens, turns, tok, k=2, max_length=len(full[2].input_ids) - 1)[2]
    assert one_over.input_ids == full[2].input_ids[1:] and one_over.prefix_len == 0  # one token over is cut too
    assert [tok.decode(cut[2].input_ids[a:b]) for _, a, b in cut[2].slots] == ["toggle and go through door",
                                                                               "pick up key"]
    # only the prefix is cut, never the plan-ahead message or the target
    tiny = build_forecast_samples(tokens, turns, tok, k=2, max_length=1)[3]
    assert tok.decode(tiny.input_ids).startswith("<|im_start|>user\nPlan ahead")


def test_prompt_without_chat_template_is_rejected(tok, episode):
    tokens, turns = episode
    with pytest.raises(ValueError, match="assistant header .* need the agent's prompts rendered with the tokenizer's "
                                         "chat template"):
        build_forecast_samples(tokens[1:], [t._replace(action_start=t.action_start - 2) for t in turns], tok, k=2)
    with pytest.raises(ValueError, match="allowed: list, turns"):
        build_forecast_samples(tokens, turns, tok, k=2, layout="grid")


def test_gate_over_known_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0,   1.0, 1.0, 1.0, 1.0,   0.0, 0.7, 0.5, 0.2])
    assert trajectory_gate(rewards, 4, "wins", 0.5).tolist() == [1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0]
    assert trajectory_gate(rewards, 4, "mixed", 0.5).tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert trajectory_gate(rewards, 4, "all", 0.5).all()
    with pytest.raises(ValueError, match="allowed: wins, all, mixed"):
        trajectory_gate(rewards, 4, "best", 0.5)


def test_group_norm_weights_hand_computed():
    """1/m_g per sample (m_g = trajectories of the group with samples), rescaled to mean 1 over samples."""
    rows = [0, 0, 0, 4, 5, 5, 6, 7]  # group 0: one trajectory, 3 samples; group 1: four trajectories, 5 samples
    samples = [ForecastSample([1, 2], [0, 1], row=r, turn=0) for r in rows]
    raw = [1, 1, 1, 0.25, 0.25, 0.25, 0.25, 0.25]
    expected = [w * len(raw) / sum(raw) for w in raw]
    weights = group_norm_weights(samples, 4)
    assert weights == pytest.approx(expected) and sum(weights) / len(weights) == pytest.approx(1.0)
    assert group_norm_weights([], 4) == []


@pytest.mark.parametrize("cut", [0, 5])
def test_forecast_loss_is_the_weighted_token_mean(tok, episode, cut):
    """L_AF = coef * sum_i w_i sum_target nll / N_target, against each sample's own forward; also when the last
    sample was left-truncated (it then shares no prefix, and the trajectory's trunk is its longest kept prefix)."""
    tokens, turns = episode
    longest = len(build_forecast_samples(tokens, turns, tok, k=2)[2].input_ids)
    samples = build_forecast_samples(tokens, turns, tok, k=2, row=0, max_length=longest - cut)[:3]
    assert [s.prefix_len == 0 for s in samples] == [False, False, cut > 0]
    for s, w in zip(samples, (2.0, 0.5, 1.0)):
        s.weight = w
    model = tiny_model(len(tok))
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.input_ids])).logits[0]
            for j in range(1, len(s.input_ids)):
                if s.loss_mask[j]:
                    total += s.weight * -float(torch.log_softmax(logits[j - 1], -1)[s.input_ids[j]])
                    count += 1
        kept = []

        def logits_fn(ids, mask, pos, keep):
            kept.append(keep.tolist())
            return model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep).logits

        loss = forecast_loss(logits_fn, samples, coef=0.01)
    assert count > 10 and abs(float(loss) - 0.01 * total / count) < 1e-5
    # the LM head runs only at the columns whose logits predict a target token
    assert kept == [sorted(set(pack_forecast_samples(samples).logit_index[:, 1].tolist()))]


def test_packed_forecast_nll_reads_the_logits_at_the_rollout_temperature(tok, episode):
    """What the actor calls with its packed rows' logits: coef * sum_i w_i * -log softmax(z_i / T)[label_i] / N over
    the N target tokens, z_i the logits ``logit_index`` points at, T the rollout temperature (OpenRLHF's
    Actor.forward divides the policy's logits by it too); no target tokens: 0, still part of the graph."""
    tokens, turns = episode
    samples = build_forecast_samples(tokens, turns, tok, k=2, row=0)[:3]
    for s, w in zip(samples, (2.0, 0.5, 1.0)):
        s.weight = w
    packed = pack_forecast_samples(samples)
    torch.manual_seed(0)
    logits = torch.randn(*packed.rows.input_ids.shape, len(tok), requires_grad=True)
    expected = sum(w * -torch.log_softmax(logits[r, c] / 2.0, -1)[label]
                   for (r, c), label, w in zip(packed.logit_index.tolist(), packed.labels.tolist(),
                                               packed.weights.tolist()))
    loss = packed_forecast_nll(logits, packed, coef=0.3, temperature=2.0)
    assert len(packed.labels) > 10 and float(loss) == pytest.approx(0.3 * float(expected) / len(packed.labels))
    assert float(loss) != pytest.approx(float(packed_forecast_nll(logits, packed, coef=0.3)), rel=1e-3)
    empty = packed_forecast_nll(logits, pack_forecast_samples([]), coef=0.3, temperature=2.0)
    assert float(empty) == 0.0 and empty.requires_grad


def test_joint_mode_packs_one_row_per_trunk_with_or_without_samples(tok, episode):
    """With ``trunks`` (joint mode: the PPO micro-batch's rows), row r of the packed rows is trunk r with sample.row
    == r's samples after it, in the trunks' order, at least ``width`` wide; a micro-batch without samples packs too
    (an empty, integer target index; the trunk columns kept for the policy's logits)."""
    tokens, turns = episode
    samples = build_forecast_samples(tokens, turns, tok, k=2, row=1)
    other = tokens[:9]
    packed = pack_forecast_samples(samples, trunks=[other, tokens], width=3 * len(tokens))
    assert packed.rows.input_ids.shape == (2, 3 * len(tokens))
    assert packed.rows.input_ids[0, :9].tolist() == other and int((packed.rows.segment[0] >= 0).sum()) == 9
    assert packed.rows.input_ids[1, : len(tokens)].tolist() == tokens
    assert set(packed.logit_index[:, 0].tolist()) == {1} and len(packed.labels) == sum(sum(s.loss_mask[1:])
                                                                                       for s in samples)
    empty = pack_forecast_samples([], trunks=[other], width=12)
    assert empty.rows.input_ids.shape == (1, 12)
    assert (empty.logit_index.dtype, empty.logit_index.shape, empty.labels.dtype) == (torch.long, (0, 2), torch.long)
    keep, kept = kept_logit_columns(empty, trunk_width=12)
    assert keep.tolist() == list(range(12)) and kept.logit_index.shape == (0, 2)


def test_the_action_format_reads_the_feedback_without_the_chat_templates_special_tokens(tok, episode):
    """``is_invalid`` (an agent func's own, or a user's) gets the text after each action as the env wrote it,
    between the chat template's turns, never the template's special tokens."""
    tokens, turns = episode
    seen = []

    class Recording(ReActFormat):
        @staticmethod
        def is_invalid(observation: str) -> bool:
            seen.append(observation)
            return False

    assert rejected_turns(tokens, turns, tok, Recording()) == [False] * 4
    assert seen == [f"\nuser\n{feedback}\nassistant\n" for feedback in OBS[1:]]


def test_forecast_weights_gate_and_group_norm(tok):
    """The maker's part (gate, 1/m_g) of the forecast samples; the actor's part (build the rows of weight > 0, rescale
    the weights to mean 1 over the samples) then gives the whole-batch reference's samples."""
    episodes = []
    for g, rewards in enumerate([(1.0, 0.0), (1.0, 1.0)]):
        for r in rewards:
            episodes.append(to_experience(agent_response(tok, OBS[:3], ACTS[:2], reward=r)))
    batches = [Experience.concat_experiences(part, tok.pad_token_id) for part in (episodes[:3], episodes[3:])]
    batches[0].index, batches[1].index = [0, 1, 2], [3]
    config = CoPEConfig(action_forecast_enable=True, action_forecast_gate="wins", action_forecast_group_norm=True)
    weights, metrics = forecast_weights(batches, tok, config, n=2)
    assert metrics == {"cope/forecast_kept_frac": 0.75}
    assert [w.tolist() for w in weights] == [[1.0, 0.0, 0.5], [0.5]]  # group 1: two winners, 1/2 each
    rows = unpadded_trajectories(batches)
    built = [s for e, w in zip(batches, weights) for p, x in zip(e.index, w.tolist()) if x > 0
             for s in build_forecast_samples(*rows[p], tok, config.action_forecast_k, row=p, weight=x)]
    scale = len(built) / sum(s.weight for s in built)
    reference, _ = forecast_samples_from_experiences(batches, tok, config, n=2)
    assert [(s.row, s.turn, s.input_ids, s.weight * scale) for s in built] == \
        [(s.row, s.turn, s.input_ids, pytest.approx(s.weight)) for s in reference]
    assert {s.row: s.weight for s in reference} == pytest.approx({0: 1.5, 2: 0.75, 3: 0.75})

    def kept(cfg):
        return {p for e, w in zip(batches, forecast_weights(batches, tok, cfg, n=2)[0])
                for p, x in zip(e.index, w.tolist()) if x > 0}

    assert kept(CoPEConfig(action_forecast_gate="mixed")) == {0}
    # gate "all": losers train the forecast, unless group norm is on (upstream: winners only)
    assert kept(CoPEConfig(action_forecast_gate="all")) == {0, 1, 2, 3}
    assert kept(CoPEConfig(action_forecast_gate="all", action_forecast_group_norm=True)) == {0, 2, 3}


def test_forecast_weights_count_only_trajectories_that_issue_samples(tok):
    """Without group norm each kept trajectory weighs 1; with skip-invalid, a winner whose every action was answered
    "invalid action" issues no sample, weighs 0 and leaves its group's m_g (its group mate then weighs 1, not 1/2)."""
    invalid_obs = [OBS[0], "Invalid action.", "Invalid action."]
    episodes = [to_experience(agent_response(tok, obs, ACTS[:2], reward=r))
                for obs, r in ((OBS[:3], 1.0), (invalid_obs, 1.0), (OBS[:3], 1.0), (OBS[:3], 0.0))]
    batch = Experience.concat_experiences(episodes, tok.pad_token_id)
    batch.index = [0, 1, 2, 3]

    def weights(**flags):
        return forecast_weights([batch], tok, CoPEConfig(action_forecast_gate="wins", **flags), n=2)[0][0].tolist()

    assert weights(action_forecast_group_norm=False, action_forecast_skip_invalid=False) == [1.0, 1.0, 1.0, 0.0]
    assert weights(action_forecast_group_norm=True, action_forecast_skip_invalid=False) == [0.5, 0.5, 1.0, 0.0]
    assert weights(action_forecast_group_norm=True, action_forecast_skip_invalid=True) == [1.0, 0.0, 1.0, 0.0]
    assert weights(action_forecast_group_norm=False, action_forecast_skip_invalid=True) == [1.0, 0.0, 1.0, 0.0]
