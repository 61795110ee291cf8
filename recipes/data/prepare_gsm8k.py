"""Convert GSM8K into the JSONL the gsm8k recipes read (run once, on a machine with internet).

    python recipes/data/prepare_gsm8k.py                    # downloads openai/gsm8k through `datasets`
    python recipes/data/prepare_gsm8k.py --parquet-dir DIR  # or converts the two parquet files you fetched

Writes recipes/data/gsm8k_train.jsonl and gsm8k_test.jsonl with a chat-message `prompt` (a system
prompt asking for <think>/<answer> tags) and the numeric `answer` (the text after '####').
"""

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEM = ("Solve the math problem. Think step by step inside <think> </think>, then give only the final "
          "number inside <answer> </answer>.")


def convert(rows) -> list[dict]:
    out = []
    for r in rows:
        answer = r["answer"].split("####")[-1].strip().replace(",", "")
        out.append({"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}],
                    "answer": answer})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parquet-dir", help="folder holding GSM8K's main/train-*.parquet and main/test-*.parquet")
    args = ap.parse_args()
    from datasets import load_dataset
    if args.parquet_dir:
        files = {s: str(next(Path(args.parquet_dir).rglob(f"{s}-*.parquet"))) for s in ("train", "test")}
        splits = load_dataset("parquet", data_files=files)
    else:
        splits = load_dataset("openai/gsm8k", "main")
    for split in ("train", "test"):
        rows = convert(splits[split])
        with open(HERE / f"gsm8k_{split}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"wrote {len(rows)} rows to {HERE / f'gsm8k_{split}.jsonl'}")


if __name__ == "__main__":
    main()
