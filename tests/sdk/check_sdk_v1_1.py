"""What the official TypeSafe Python SDK (typesafe-sdk 0.7.5, unchanged) sees of a v1.1 model.

Run by crates/prism-cli/tests/serve_v1_1.rs against `prism serve --demo v1.1` (no API key), with
TYPESAFE_BASE_URL, and NULL_STATE / NULL_INSTRUCTIONS / NULL_CRITERIA (JSON): a choice question that
this server answers with a null choice (the none option is the most likely).

Checks:
- the v1.1 settings go through the SDK's `extra_body` (think_mode, return_thought, return_details, seed,
  allow_none), and the SDK reads the answers: it ignores the fields its models do not know
  (`none_probability`, `thought`, `x_details`), which stay in `raw_http_response.json()`;
- a null choice breaks the SDK's default response model (its ChoiceAnswer.choice must be a string): the
  call raises, and we print what it raises;
- `extra_body={"allow_none": False}` gets that same question a listed option the SDK reads.
Prints one JSON object on stdout; any failed check raises (exit status 1).
"""

import json
import os
import sys

from typesafe_sdk import Choice, Noul, RetryPolicy, Score, TypeSafeClient, __version__

NO_RETRY = RetryPolicy(max_retries=0)


def main() -> None:
    report = {"sdk_version": __version__}
    with TypeSafeClient(retry=NO_RETRY) as client:
        questions = {
            "team": Choice(
                instructions="Which team should handle this ticket?",
                criteria={"billing": "Payments and invoices", "technical": "Bugs and outages"},
            ),
            "urgent": Noul(instructions="Does this ticket need a reply today?"),
            "mood": Score(instructions="How upset is the customer?", criteria=["calm", "annoyed", "angry"]),
        }
        result = client.system_one(
            state="I was charged twice for my March invoice.",
            questions=questions,
            extra_body={
                "think_mode": "always",
                "return_thought": True,
                "return_details": True,
                "seed": 7,
                "allow_none": False,
            },
        )
        team = result.choices["team"]
        assert team.choice in {"billing", "technical"}, team
        raw = result.raw_http_response.json()
        for name in ("team", "urgent", "mood"):
            answer = raw["answers"][name]
            assert isinstance(answer["thought"], str), answer
            assert answer["x_details"]["thought_tokens"] >= 1, answer
        assert isinstance(raw["answers"]["team"]["none_probability"], float), raw["answers"]["team"]
        assert result.usage.output_tokens == sum(
            raw["answers"][n]["x_details"]["thought_tokens"] for n in ("team", "urgent", "mood")
        ), (result.usage, raw)
        report["thinking"] = {"output_tokens": result.usage.output_tokens, "answers": raw["answers"]}

        # A null choice: the SDK's default response model cannot hold it.
        null_question = {
            "pick": Choice(
                instructions=os.environ["NULL_INSTRUCTIONS"],
                criteria=json.loads(os.environ["NULL_CRITERIA"]),
            )
        }
        state = os.environ["NULL_STATE"]
        try:
            client.system_one(state=state, questions=null_question, extra_body={"think_mode": "never"})
            raise AssertionError("the SDK read a null choice")
        except AssertionError:
            raise
        except Exception as error:  # noqa: BLE001 - we report what the SDK raises
            report["null_choice_error"] = f"{type(error).__module__}.{type(error).__name__}"
            report["null_choice_message"] = str(error)[:300]
        # allow_none false: the same question gets a listed option, and none_probability stays.
        listed = client.system_one(
            state=state, questions=null_question, extra_body={"think_mode": "never", "allow_none": False}
        )
        pick = listed.choices["pick"]
        assert pick.choice in json.loads(os.environ["NULL_CRITERIA"]), pick
        raw = listed.raw_http_response.json()["answers"]["pick"]
        assert raw["none_probability"] > max(raw["probabilities"].values()), raw
        report["allow_none_false"] = raw
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
