"""Writes the small task datasets the recipes use (deterministic; the outputs are committed too).

    python recipes/data/make_data.py        # from the repository root

arithmetic_{train,eval}.jsonl   "What is a + b?" chat prompts with an `answer` column (README demo)
toy_tokens_{train,eval}.jsonl   token-id prompts with a `label` column (vocab 32, no tokenizer)
char_e_{train,eval}.jsonl       short text prompts for the character-level `e` task
reverse_{train,eval}.jsonl      "Write the word X backwards" prompts with the expected string (Qwen recipe)
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

# toy_tokens vocabulary: 0 pad, 1 eos, 2 <think>, 3 </think>, 4 <answer>, 5 </answer>, 6..31 ordinary tokens
TOY_FIRST_ORDINARY, TOY_VOCAB = 6, 32


def write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def arithmetic(rng: random.Random, n: int, seen: set) -> list[dict]:
    rows = []
    while len(rows) < n:
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"prompt": f"What is {a} + {b}? Answer with just the number.", "answer": a + b})
    return rows


def toy_tokens(rng: random.Random, n: int) -> list[dict]:
    # The label is the prompt's first token: the policy must learn the answer format, then to copy it.
    rows = []
    for _ in range(n):
        ids = [rng.randrange(TOY_FIRST_ORDINARY, TOY_VOCAB) for _ in range(rng.randint(3, 6))]
        rows.append({"prompt_ids": ids, "label": ids[0]})
    return rows


def char_e(rng: random.Random, n: int) -> list[dict]:
    words = ["cat", "dog", "sun", "map", "cup", "hat", "box", "fig", "jam", "kit", "log", "mud", "nut", "owl"]
    return [{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) + ":"} for _ in range(n)]


WORDS = ("apple banana cherry garden window planet silver rocket purple orange dragon castle forest river "
         "summer winter yellow animal bridge candle doctor engine family guitar hunter island jacket kitten "
         "ladder market needle office pencil rabbit sunset ticket velvet wallet anchor basket cactus donkey "
         "feather glacier harbor insect jungle kettle lantern meadow nectar oyster pepper quiver saddle thunder "
         "tunnel violin walnut zipper blanket compass diamond eclipse festival goblin horizon iceberg journal "
         "kingdom lobster mustard nomad orchard pyramid quartz rainbow scarf tornado umbrella volcano whistle").split()


def reverse(words: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Write the word '{w}' backwards. Reply with only the result."}],
             "answer": w[::-1]} for w in words]


def main() -> None:
    rng = random.Random(0)
    seen: set = set()
    write("arithmetic_eval.jsonl", arithmetic(rng, 200, seen))  # eval pairs never appear in training
    write("arithmetic_train.jsonl", arithmetic(rng, 600, seen))
    write("toy_tokens_train.jsonl", toy_tokens(rng, 512))
    write("toy_tokens_eval.jsonl", toy_tokens(rng, 64))
    write("char_e_train.jsonl", char_e(rng, 256))
    write("char_e_eval.jsonl", char_e(rng, 32))
    words = WORDS[:]
    rng.shuffle(words)
    write("reverse_eval.jsonl", reverse(words[:20]))
    write("reverse_train.jsonl", reverse(words[20:]))


if __name__ == "__main__":
    main()
