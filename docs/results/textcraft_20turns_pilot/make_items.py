"""The 20-turn TextCraft pilot's items (session 27): RL on unseen texts of training goals, held-out split in two.

Goals: T = the warm start's 344 training goals (SFT saw texts 0-2 of each), A = the 25th session pilot's 100 held-out
goals (a subset of T, scored on text 3). B = 100 more goals of T (seeded draw). RL prompts: texts 4, 5, 6
(id = goal + 544 k) of every goal in T - A. Held-out: text 3 of A (goals RL never plays) then text 3 of B (goals RL
plays in other texts)."""
import json, random
src = "/work/tc25pilot/textcraft/warm_start/data"
ids = lambda path: [int(json.loads(l)["label"]) for l in open(path)]
T = sorted({i % 544 for i in ids(f"{src}/train.jsonl")})
A = [i % 544 for i in ids(f"{src}/heldout.jsonl")]
assert len(T) == 344 and len(A) == 100 and set(A) <= set(T)
rest = sorted(set(T) - set(A))
B = random.Random(0).sample(rest, 100)
rows = lambda items: "".join(json.dumps({"prompt": f"textcraft/{i}", "label": str(i)}) + "\n" for i in items)
train = [g + 544 * k for k in (4, 5, 6) for g in rest]
random.Random(1).shuffle(train)
open("textcraft/warm_start/data/train.jsonl", "w").write(rows(train))
open("textcraft/warm_start/data/heldout.jsonl", "w").write(rows([g + 544 * 3 for g in A + B]))
json.dump({"A": A, "B": B}, open("goal_sets.json", "w"))
print(len(train), "RL prompts;", len(A) + len(B), "held-out")
