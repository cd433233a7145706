"""trainer.data.regeneration / trainer.data.endpoint / trainer.data.response_journal: the target's answers in
process and through a loopback OpenAI-compatible server (real `generate`), token for token; retries,
resume after a dead server and after kill -9, nothing lost or duplicated; wrong models refused."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import datasets
import pytest

from benchmarks.openai_loopback import LoopbackOpenAI
from tests.support.tiny_target import tiny_target
from trainer.data import regeneration as regeneration_module
from trainer.data.endpoint import EndpointError, EndpointSettings
from trainer.data.regeneration import GenerationSettings, answer_points, prompt_conversation, regenerate
from trainer.data.response_journal import ResponseJournal
from trainer.fileio import DiskFullError
from trainer.locks import FolderInUseError

REPO = Path(__file__).resolve().parents[2]
MULTI_TURN = [
    {"role": "user", "content": "hi how are you"},
    {"role": "assistant", "content": "i am fine thanks"},
    {"role": "user", "content": "what is the capital of france"},
    {"role": "assistant", "content": "paris"},
]
CONVERSATIONS = [
    prompt_conversation("hello"),
    prompt_conversation("tell me about the weather today"),
    MULTI_TURN,
    [{"role": "system", "content": "you like music"}, {"role": "user", "content": "what do you like"}],
    prompt_conversation("good morning"),
    [  # ends on a user turn: two answers, the second appended
        {"role": "user", "content": "good evening"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "tell me about music"},
    ],
]
# batch 1: no padding, so in process and the server (one prompt per request) compute the same thing
SETTINGS = GenerationSettings(max_new_tokens=6, batch_size=1)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def fast(server: LoopbackOpenAI, **overrides) -> EndpointSettings:
    """Endpoint settings with test-sized backoff."""
    values = {"url": server.url, "concurrency": 3, "backoff": 0.01, "max_backoff": 0.05, "max_retries": 4}
    return EndpointSettings(**{**values, **overrides})


def rows(dataset: datasets.Dataset) -> list[tuple]:
    return list(zip(dataset["input_ids"], dataset["loss_mask"], dataset["response"], strict=True))


@pytest.fixture(scope="module")
def in_process(target, tmp_path_factory):
    return regenerate(target, CONVERSATIONS, SETTINGS, tmp_path_factory.mktemp("in-process"))


def test_answer_points_and_the_refused_conversation():
    assert answer_points(MULTI_TURN) == [1, 3]
    assert answer_points(MULTI_TURN[:3]) == [1, 3]  # the last user turn gets an appended answer
    assert answer_points(prompt_conversation("hi", "be brief")) == [2]
    with pytest.raises(ValueError, match="starts with an assistant turn"):
        answer_points(MULTI_TURN[1:])


def test_endpoint_regeneration_equals_in_process_token_for_token(target, tmp_path, in_process):
    with LoopbackOpenAI(target) as server:
        through_server = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
    assert rows(through_server) == rows(in_process)
    assert len(in_process) == len(CONVERSATIONS)
    # the one-answer samples are the templated prompt then the target's own tokens, through <|im_end|>
    tokenizer = target.tokenizer
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, return_dict=True)["input_ids"]
    first = in_process[0]
    assert first["input_ids"][: len(prompt)] == list(prompt)
    assert first["loss_mask"] == [0] * len(prompt) + [1] * (len(first["input_ids"]) - len(prompt))


def test_each_turn_is_answered_after_the_regenerated_history(target, tmp_path, in_process):
    """The second question reaches the server after the target's own first answer, not the
    dataset's; the sample supervises both answers."""
    with LoopbackOpenAI(target) as server:
        regenerate(target, [MULTI_TURN], SETTINGS, tmp_path, endpoint=fast(server))
    asked = [json.loads(messages) for messages in server.asked if "france" in messages]
    assert len(asked) == 1 and len(asked[0]) == 3
    first_answer = asked[0][1]["content"]
    assert first_answer != MULTI_TURN[1]["content"]
    tokenizer = target.tokenizer
    sample = in_process[2]
    supervised = [t for t, m in zip(sample["input_ids"], sample["loss_mask"], strict=True) if m]
    expected = [*tokenizer.encode(first_answer, add_special_tokens=False), tokenizer.eos_token_id]
    assert supervised[: len(expected)] == expected
    assert sample["response"] != MULTI_TURN[3]["content"]


def test_a_server_failing_every_third_request_is_survived(target, tmp_path, in_process):
    with LoopbackOpenAI(target) as server:
        server.fail_every = 3
        dataset = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
    assert rows(dataset) == rows(in_process)
    assert server.requests > server.completions  # failures happened and were retried
    assert len(server.asked) == len(set(server.asked))  # no question answered twice
    assert not list((tmp_path / "generated").glob("*.journal.jsonl"))  # the journal is gone once written


def test_a_server_that_dies_mid_run_is_resumed_without_repeats(target, tmp_path, in_process):
    with LoopbackOpenAI(target) as dying:
        dying.die_after = 4  # the probe and three answers, then the process is gone
        with pytest.raises(EndpointError, match="still failing after 5 attempts"):
            regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(dying))
    (journal_path,) = (tmp_path / "generated").glob("*.journal.jsonl")
    finished = {json.loads(line)["row"] for line in journal_path.read_text().splitlines()}
    assert 0 < len(finished) < len(CONVERSATIONS)
    with LoopbackOpenAI(target) as restarted:  # another port: the URL is not part of the cache key
        dataset = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(restarted))
    assert rows(dataset) == rows(in_process)
    # exactly the unfinished conversations' turns were asked again (after the probe)
    unfinished = [row for row in range(len(CONVERSATIONS)) if row not in finished]
    assert restarted.completions - 1 == sum(len(answer_points(CONVERSATIONS[row])) for row in unfinished)


def test_kill_9_during_endpoint_regeneration_then_rerun_gives_the_uninterrupted_dataset(target, tmp_path, in_process):
    many = CONVERSATIONS * 4
    child = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.support.tiny_target import tiny_target
        from tests.integration.test_regeneration import CONVERSATIONS, SETTINGS
        from trainer.data.endpoint import EndpointSettings
        from trainer.data.regeneration import regenerate
        regenerate(tiny_target(), CONVERSATIONS * 4, SETTINGS, __import__("pathlib").Path({str(tmp_path)!r}),
                   endpoint=EndpointSettings(url=sys.argv[1], concurrency=2))
        """
    )
    with LoopbackOpenAI(target) as server:
        server.delay = 0.2  # slow answers, so the kill lands mid-run
        process = subprocess.Popen([sys.executable, "-c", child, server.url], cwd=REPO)
        journal = tmp_path / "generated"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = sum(len(path.read_bytes().splitlines()) for path in journal.glob("*.journal.jsonl"))
            if lines >= 5:
                break
            assert process.poll() is None, "the regeneration ended before it could be killed"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        (journal_path,) = journal.glob("*.journal.jsonl")
        finished = set()
        for line in journal_path.read_bytes().splitlines(keepends=True):
            if line.endswith(b"\n"):  # a torn last line is not a finished conversation
                finished.add(json.loads(line)["row"])
        assert 5 <= len(finished) < len(many)
        server.delay = 0.0
        server.wait_idle()
        asked_before = len(server.asked)
        dataset = regenerate(target, many, SETTINGS, tmp_path, endpoint=fast(server))
    assert rows(dataset) == rows(in_process) * 4
    # the rerun asked the probe and every turn of the unfinished conversations, nothing else
    unfinished = [row for row in range(len(many)) if row not in finished]
    assert len(server.asked) - asked_before == 1 + sum(len(answer_points(many[row])) for row in unfinished)


def test_timeouts_are_retried_then_reported_with_what_is_kept(target, tmp_path):
    with LoopbackOpenAI(target) as server:
        server.delay = 1.0
        with pytest.raises(
            EndpointError,
            match=r"still failing after 2 attempts \(no whole answer within regenerate_timeout=0.3 s.*0 of 6 convers",
        ):
            regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server, timeout=0.3, max_retries=1))
        server.wait_idle()


def test_a_conversation_the_server_refuses_is_skipped_and_counted(target, tmp_path, in_process, caplog):
    with LoopbackOpenAI(target) as server:
        server.refuse_containing = "weather"
        dataset = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
    assert rows(dataset) == rows(in_process)[:1] + rows(in_process)[2:]
    assert "Skipping 1 of 6 prompts (1 refused by the endpoint)" in caplog.text


def test_journal_drops_a_torn_last_line_and_never_duplicates(tmp_path):
    path = tmp_path / "answers.jsonl"
    with ResponseJournal(path, 3, 100) as journal:
        journal.append({"row": 2, "turns": [{"text": "b", "ids": [2]}]})
        journal.append({"row": 0, "turns": [{"text": "a", "ids": [1]}]})
        journal.append({"row": 2, "turns": [{"text": "again", "ids": [9]}]})  # ignored: row 2 is done
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"row": 1, "tur')  # kill -9 in the middle of a write
    with ResponseJournal(path, 3, 100) as journal:
        assert journal.done == {0, 2}
        assert path.read_bytes() == whole
        journal.append({"row": 1, "skipped": "too long"})
        assert [record["row"] for record in journal.records()] == [0, 1, 2]  # row order, from disk
        assert next(journal.records())["turns"][0]["text"] == "a"


def test_wrong_model_endpoints_are_refused(target, tmp_path):
    with LoopbackOpenAI(target, model_name="served-name") as server:
        with pytest.raises(
            EndpointError, match=r"regenerate_model 'other' is not served by .* \(it serves: served-name\)"
        ):
            regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server, model="other"))
        regenerate(target, CONVERSATIONS[:1], SETTINGS, tmp_path, endpoint=fast(server, model="served-name"))
    other_template = "{% for m in messages %}{{ m['role'] + ' ' + m['content'] + ' ' }}{% endfor %}assistant "
    refusal = "is not the recipe's target: it reads the probe conversation as"
    with LoopbackOpenAI(target, chat_template=other_template) as server, pytest.raises(EndpointError, match=refusal):
        regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
    with LoopbackOpenAI(target) as server:
        server.token_shift = 1  # same template and lengths, another vocabulary
        with pytest.raises(EndpointError, match="gives other token ids than the target's"):
            regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
    with pytest.raises(EndpointError, match="cannot be reached"):
        regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))  # stopped: nothing listens


def test_large_datasets_are_written_in_shards_and_read_lazily(target, tmp_path, monkeypatch, in_process):
    """A dataset of conversations is regenerated from its (memory-mapped) rows, and the result is
    written a shard at a time: the same samples as from a list."""
    source = tmp_path / "source"
    datasets.Dataset.from_dict({"messages": CONVERSATIONS}).save_to_disk(str(source), num_shards=3)
    from trainer.data.dataset import ConversationRows

    lazy = ConversationRows(datasets.load_from_disk(str(source)), "messages")
    assert [lazy[i] for i in range(len(lazy))] == CONVERSATIONS and list(lazy[2:4]) == CONVERSATIONS[2:4]
    assert regeneration_module.conversations_digest(lazy) == regeneration_module.conversations_digest(CONVERSATIONS)
    monkeypatch.setattr(regeneration_module, "SHARD_SAMPLES", 4)
    dataset = regenerate(target, lazy, SETTINGS, tmp_path / "cache")
    assert rows(dataset) == rows(in_process)


def test_prepare_regenerates_through_the_endpoint_with_the_tokenizer_alone_and_training_reuses_it(
    target, tmp_path, monkeypatch
):
    from tests.support.distributed.tiny_setup import write_tiny_run
    from trainer.commands import prepare
    from trainer.data.dataset import build_datasets
    from trainer.models.target import FrozenTarget
    from trainer.training.arguments import parse_arguments

    recipe = write_tiny_run(tmp_path, regenerate=True, max_new_tokens=6, generation_batch_size=1)
    with LoopbackOpenAI(target) as server:
        flags = [str(recipe), "--regenerate_endpoint", server.url, "--regenerate_concurrency", "4"]
        with monkeypatch.context() as patched:  # the weights are never loaded
            patched.setattr(FrozenTarget, "load", lambda *a, **k: pytest.fail("loaded the target's weights"))
            prepare.main([*flags, "--regenerate-only"])
    assert server.completions == 2 + 24  # a probe each for train and eval, then every conversation's one turn
    # training, with the server gone, finds the answers in the cache
    _, data_args, _ = parse_arguments(flags)
    train, evaluation = build_datasets(data_args, FrozenTarget.load(str(tmp_path / "target")), [1, 2])
    assert (len(train), len(evaluation)) == (20, 4)
    in_process, _ = build_datasets(
        dataclasses.replace(data_args, regenerate_endpoint=None, cache_dir=str(tmp_path / "other")), target, [1, 2]
    )
    assert train["input_ids"] == in_process["input_ids"]


def test_endpoint_recipe_keys_are_checked(tmp_path):
    from trainer.data.dataset import endpoint_settings
    from trainer.training.arguments import DataArguments

    assert endpoint_settings(DataArguments(regenerate=True)) is None
    with pytest.raises(ValueError, match="regenerate_model is set but regenerate_endpoint is not"):
        endpoint_settings(DataArguments(regenerate=True, regenerate_model="m"))
    with pytest.raises(ValueError, match="regenerate_endpoint is set but regenerate is false"):
        endpoint_settings(DataArguments(regenerate=False, regenerate_endpoint="http://h:8000/v1"))
    with pytest.raises(ValueError, match="must be an http"):
        endpoint_settings(DataArguments(regenerate=True, regenerate_endpoint="h:8000/v1"))
    with pytest.raises(ValueError, match="regenerate_concurrency must be >= 1"):
        endpoint_settings(DataArguments(regenerate=True, regenerate_endpoint="http://h/v1", regenerate_concurrency=0))
    settings = endpoint_settings(
        DataArguments(regenerate=True, regenerate_endpoint="http://h/v1", enable_thinking=False)
    )
    assert settings.chat_template_kwargs == {"enable_thinking": False}


# -- reliability (issue 22) --------------------------------------------------------------------------


def journal_of(cache: Path) -> Path:
    (path,) = (cache / "generated").glob("*.journal.jsonl")
    return path


def test_a_damaged_journal_loses_only_its_bad_lines_and_a_full_disk_keeps_it(
    target, tmp_path, in_process, monkeypatch, caplog
):
    """A full disk while the dataset is written keeps the whole journal; a garbage line and a row
    out of range in the middle of it cost those two conversations, not everything after them."""
    many = CONVERSATIONS * 2

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with LoopbackOpenAI(target) as server:
        with monkeypatch.context() as patched:
            patched.setattr(datasets.Dataset, "save_to_disk", full)
            with pytest.raises(DiskFullError) as error:
                regenerate(target, many, SETTINGS, tmp_path, endpoint=fast(server))
        journal = journal_of(tmp_path)
        entry = journal.with_name(journal.name.removesuffix(".journal.jsonl"))
        assert str(error.value).startswith(f"no space left on device while writing the regenerated dataset {entry} (")
        assert str(error.value).endswith(
            f"the 12 conversations are kept in the journal {journal}: free space, then rerun to resume"
        )
        lines = journal.read_text().splitlines()
        assert len(lines) == 12 and not entry.exists()
        dropped = [json.loads(lines[3])["row"], json.loads(lines[6])["row"]]
        lines[3] = "garbage"
        lines[6] = lines[6].replace(f'"row": {dropped[1]}', '"row": 15')
        journal.write_text("\n".join(lines) + "\n")
        asked_before = server.completions
        caplog.clear()
        dataset = regenerate(target, many, SETTINGS, tmp_path, endpoint=fast(server))
    assert rows(dataset) == rows(in_process) * 2
    assert server.completions - asked_before == 1 + sum(len(answer_points(many[row])) for row in dropped)
    assert (
        f"journal {journal}: kept 10 records, dropped 2 invalid (line 4: not JSON; line 7: row 15 out of range (0..11))"
        in caplog.text
    )


def test_empty_answers_are_counted_never_cached_and_asked_again(target, tmp_path, in_process):
    with LoopbackOpenAI(target) as empty:
        empty.empty_answers = True
        with pytest.raises(ValueError) as error:
            regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, name="dataset chat", endpoint=fast(empty))
    journal = journal_of(tmp_path)
    assert str(error.value) == (
        "dataset chat: none of the 6 conversations was answered (6 answered with nothing (empty answer)); nothing is "
        f"cached, and the journal {journal} is kept: a rerun asks again for the 6 refused or answered with nothing "
        "(remove the journal to start over)"
    )
    assert [p.name for p in (tmp_path / "generated").iterdir() if not p.name.startswith(".")] == [journal.name]
    with LoopbackOpenAI(target) as good:
        dataset = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(good))
    assert rows(dataset) == rows(in_process)
    assert good.completions == 1 + sum(len(answer_points(messages)) for messages in CONVERSATIONS)


def test_answers_cut_at_max_tokens_are_counted_in_the_one_summary(target, tmp_path, caplog):
    prompts = [prompt_conversation(p) for p in ("hi", "tell me about the weather today", "good morning")]
    regenerate(target, prompts, GenerationSettings(max_new_tokens=1), tmp_path, name="dataset p")
    assert (
        "dataset p: every one of the 3 answers was cut at regenerate_max_tokens=1: none ends its turn, so the draft "
        "never learns how answers end; raise regenerate_max_tokens." in caplog.text
    )


@pytest.mark.parametrize(
    ("route", "content_type", "body", "message"),
    [
        (
            "models",
            "text/html",
            b"<html><body>Sign in</body></html>",
            r"/v1/models answered HTTP 200 with a body that is not JSON \(content-type text/html\): '<html><body>",
        ),
        ("models", "application/json", b'{"data": 5}', r"GET /models answered a malformed body"),
        (
            "completions",
            "text/html",
            b"<html>proxy error</html>",
            r"/chat/completions answered HTTP 200 with a body that is not JSON \(content-type text/html\): '<html>",
        ),
        (
            "completions",
            "application/json",
            b'{"usage": {}}',
            r"/v1/chat/completions answered a body without `choices`",
        ),
        (
            "completions",
            "application/json",
            b'{"choices": []}',
            r"/v1/chat/completions answered an empty `choices` list",
        ),
        (
            "completions",
            "application/json",
            b'{"choices": [{"message": null}]}',
            r"/v1/chat/completions answered a choice whose `message` is null",
        ),
        (
            "completions",
            "application/json",
            b'{"choices": [{"message": {"content": [1]}}]}',
            r"`message.content` that is not a string: \[1\]",
        ),
        ("completions", "application/json", b"[1]", r"/v1/chat/completions answered list JSON, not an object"),
    ],
)
def test_every_malformed_body_is_an_endpoint_error_naming_the_url(target, tmp_path, route, content_type, body, message):
    with LoopbackOpenAI(target) as server:
        setattr(server, f"raw_{route}", (content_type, body))
        with pytest.raises(EndpointError, match=message) as error:
            regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
    assert server.url in str(error.value)


def test_a_trickling_server_is_cut_off_by_the_whole_request_deadline(target, tmp_path, capsys):
    from tests.support.distributed.tiny_setup import write_tiny_run
    from trainer.commands import prepare
    from trainer.commands.runner import run

    recipe = write_tiny_run(tmp_path, regenerate=True, max_new_tokens=6, generation_batch_size=1)
    with LoopbackOpenAI(target) as server:
        server.trickle = 0.25  # every read arrives well within regenerate_timeout; the request never ends
        flags = ["--regenerate_endpoint", server.url, "--regenerate_timeout", "1", "--regenerate_max_retries", "1"]
        started = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            run(prepare.main, [str(recipe), *flags, "--regenerate-only"])
        elapsed = time.monotonic() - started
    assert exit_info.value.code == 2 and elapsed < 15
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {server.url}/chat/completions: still failing after 2 attempts "
        "(no whole answer within regenerate_timeout=1 s)"
    ), errors


def test_two_regenerations_of_one_entry_in_one_job_ask_once(target, tmp_path, in_process, monkeypatch):
    """Ranks of one job (same TORCHELASTIC_RUN_ID) wait for the one filling the entry, then reuse it."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    results: dict[int, object] = {}
    with LoopbackOpenAI(target) as server:
        server.delay = 0.05

        def regenerate_into(slot: int) -> None:
            try:
                results[slot] = rows(regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server)))
            except Exception as error:  # reported by the assertion below
                results[slot] = error

        threads = [threading.Thread(target=regenerate_into, args=(slot,)) for slot in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert results == {0: rows(in_process), 1: rows(in_process)}
    assert server.completions == 1 + sum(len(answer_points(messages)) for messages in CONVERSATIONS)


def test_an_entry_held_by_another_process_is_refused_naming_the_holder(target, tmp_path, in_process):
    with LoopbackOpenAI(target) as dying:
        dying.die_after = 3  # the probe and two answers: the entry is left half done, with its journal
        with pytest.raises(EndpointError):
            regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(dying, max_retries=0))
    entry = journal_of(tmp_path).with_name(journal_of(tmp_path).name.removesuffix(".journal.jsonl"))
    holder = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from trainer.locks import lock_cache_entry
        with lock_cache_entry({str(entry)!r}, "regeneration cache entry"):
            print("held", flush=True)
            sys.stdin.read()  # until the test closes it
        """
    )
    process = subprocess.Popen([sys.executable, "-c", holder], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert select.select([process.stdout], [], [], 60)[0], "the holder never took the lock"
        assert process.stdout.readline() == b"held\n"
        with LoopbackOpenAI(target) as server:
            with pytest.raises(FolderInUseError) as error:
                regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
            assert server.completions == 0  # refused before asking anything
            assert str(error.value).startswith(
                f"regeneration cache entry {entry} is in use by another run (pid {process.pid} on "
            )
            process.stdin.close()
            assert process.wait(timeout=60) == 0
            dataset = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))  # the lock is free
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert rows(dataset) == rows(in_process)


def test_a_full_disk_while_journaling_is_one_line_and_the_rerun_resumes(target, tmp_path, in_process, monkeypatch):
    from trainer.data import response_journal

    real, appended = response_journal.write_record, []

    def fills_up(descriptor: int, data: bytes) -> None:
        if len(appended) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(descriptor, data)
        appended.append(data)

    with LoopbackOpenAI(target) as server:
        with monkeypatch.context() as patched:
            patched.setattr(response_journal, "write_record", fills_up)
            with pytest.raises(DiskFullError) as error:
                regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server, concurrency=1))
        journal = journal_of(tmp_path)
        assert str(error.value).startswith(
            f"no space left on device while writing the regeneration journal {journal} ("
        )
        assert str(error.value).endswith("free); 2 of 6 conversations are kept in it: free space, then rerun to resume")
        dataset = regenerate(target, CONVERSATIONS, SETTINGS, tmp_path, endpoint=fast(server))
    assert rows(dataset) == rows(in_process)
