"""Task instructions per environment: the first user message of every episode (text only, no imports).

A chat starts with ``INSTRUCTIONS[env]`` as the user message, ``ACKNOWLEDGEMENT`` as the assistant's reply, then
the environment's first observation as the next user message. Every assistant turn after that is
``Thought:\\n<reasoning>\\n\\nAction:\\n<action>``; the environment reads the text after the last ``Action:``.
"""

ACKNOWLEDGEMENT = "Understood. I will think briefly, then give exactly one action each turn."

_FORMAT = (
    "Answer every turn in this format:\n"
    "Thought:\n<one or two sentences about what to do next>\n\n"
    "Action:\n<exactly one action>\n"
)

INSTRUCTIONS: dict[str, str] = {
    "babyai": (
        "You control an agent in a small grid world made of rooms, doors and objects (balls, keys, boxes). "
        "Each observation states your goal, lists the objects you can see with their distance in steps "
        "forward and to the left or right of you, says what is directly in front of you and what you carry, "
        "and ends with the list of actions you may take now.\n"
        "Actions: \"turn left\", \"turn right\", \"move forward\", \"go to <object>\", \"pick up <object>\", "
        "\"go through <door>\", \"toggle and go through <door>\", \"toggle\" (open a door or box in front of "
        "you), \"drop\". Objects are named as in the observation, e.g. \"red ball 1\". A locked door opens only "
        "while you carry a key of its colour. You can hold one object at a time. Copy an action exactly from "
        "the available list; anything else is rejected. Reach the goal in as few steps as you can.\n" + _FORMAT
    ),
    "textcraft": (
        "You are crafting items in a Minecraft-like text world. The first observation lists crafting commands "
        "(some of them are not needed) and the goal item. You start with an empty inventory.\n"
        "Actions:\n"
        "- get <count> <item>: take basic items that cannot be crafted, e.g. \"get 2 oak logs\".\n"
        "- craft <count> <item> using <count> <ingredient>, ...: apply one crafting command exactly as listed, "
        "e.g. \"craft 4 oak planks using 1 oak logs\". Where a command names a kind of ingredient (such as "
        "\"planks\"), name a concrete one you hold (such as \"oak planks\").\n"
        "- inventory: show what you hold.\n"
        "The task ends when you craft the goal item.\n" + _FORMAT
    ),
    "searchqa": (
        "Answer a factual question. You may search a document collection as often as you need before "
        "answering.\n"
        "Actions:\n"
        "- <search>your query</search>: returns the best matching passages between <information> and "
        "</information>.\n"
        "- <answer>your answer</answer>: give a short answer, a few words at most, such as a name, a place, a "
        "number or a date. It is checked by exact match; if it is wrong you may search again and answer again.\n"
        + _FORMAT
    ),
    "sciworld": (
        "You are doing a science experiment in a simulated house with rooms such as a kitchen, a workshop, a "
        "greenhouse and the outside. The first observation tells you the task and what you see around you; each "
        "later observation tells you what your last action did. Points are given for each part of the task you "
        "complete, and the episode ends when the task is finished (or failed).\n"
        "Actions (replace OBJ and LOC with names exactly as the observations write them):\n"
        "- moving and looking: look around, look at OBJ, look in OBJ, go to LOC, open OBJ, close OBJ, "
        "inventory, task (repeats the task)\n"
        "- handling things: pick up OBJ, put down OBJ, move OBJ to OBJ, pour OBJ in OBJ, dunk OBJ in OBJ, "
        "mix OBJ, eat OBJ, read OBJ, flush OBJ\n"
        "- devices and circuits: activate OBJ, deactivate OBJ, use OBJ on OBJ (e.g. a thermometer on a "
        "substance), connect OBJ to OBJ, disconnect OBJ\n"
        "- time: wait (ten steps), wait1 (one step)\n"
        "- focus on OBJ: marks the object the task is about. Use it only on the object the task asks for: "
        "focusing on a wrong object fails the task.\n"
        "When a name is ambiguous you are asked to choose; answer with the number of your choice.\n" + _FORMAT
    ),
    "alfworld": (
        "You are a household robot in a text game. The first observation lists the furniture and appliances in "
        "the room (numbered, e.g. \"cabinet 1\", \"countertop 2\") and states your task, such as putting an "
        "object somewhere, possibly after heating, cooling or cleaning it, or examining an object under a lamp. "
        "Objects can be inside closed receptacles, so search for them.\n"
        "Actions: go to RECEP, open RECEP, close RECEP, take OBJ from RECEP, move OBJ to RECEP, heat OBJ with "
        "RECEP (a microwave), cool OBJ with RECEP (a fridge), clean OBJ with RECEP (a sink basin), use OBJ (a "
        "lamp), slice OBJ with OBJ (a knife), examine OBJ or RECEP, inventory, look. You carry one object at a "
        "time. Write names exactly as the observations do, e.g. \"take apple 1 from countertop 2\". An action "
        "that cannot be done is answered \"Nothing happens.\" The game ends when the task is done.\n" + _FORMAT
    ),
}
