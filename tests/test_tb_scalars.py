"""cope_rlhf.tb_scalars: every scalar under a log folder, over the subfolders of resumed launches."""

from torch.utils.tensorboard import SummaryWriter

from cope_rlhf.tb_scalars import event_folders, read_scalars


def write(folder, tag, points):
    writer = SummaryWriter(str(folder))
    for step, value in points:
        writer.add_scalar(tag, value, step)
    writer.close()


def test_reads_every_launch_and_a_later_launch_wins_its_steps(tmp_path):
    # values exact in float32, the event file's type
    write(tmp_path / "launch_a", "train/kl", [(1, 0.125), (2, 0.25)])
    write(tmp_path / "launch_b", "train/kl", [(2, 0.75), (3, 0.375)])
    write(tmp_path / "launch_b", "eval/success_rate", [(0, 0.5)])
    assert read_scalars(str(tmp_path)) == {"train/kl": {1: 0.125, 2: 0.75, 3: 0.375}, "eval/success_rate": {0: 0.5}}
    assert read_scalars(str(tmp_path), ["launch_a"]) == {"train/kl": {1: 0.125, 2: 0.25}}
    assert len(event_folders(str(tmp_path))) == 2


def test_events_written_into_the_folder_itself_and_nothing_there(tmp_path):
    write(tmp_path, "rollout/success_rate", [(s, s / 20000) for s in range(12000)])  # above the reader's sampling
    assert len(read_scalars(str(tmp_path))["rollout/success_rate"]) == 12000
    assert read_scalars(str(tmp_path / "missing")) == {} and event_folders(str(tmp_path / "missing")) == []
