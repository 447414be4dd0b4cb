"""torch-npu2 serve with the official openai client over a real socket: a uvicorn server on 127.0.0.1 (a free
port) in this process, serving the tiny patched Llama on the emulated NPU2."""
import json
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

openai = pytest.importorskip("openai", reason="the server tests use the official client (pip install openai)")
pytest.importorskip("fastapi", reason="the server needs FastAPI and uvicorn (pip install 'torch_npu2[serve]')")

from torch_npu2.serve import create_app  # noqa: E402
from torch_npu2.textgen import Sampling, chat_input_ids, generate, text_input_ids  # noqa: E402

MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Hello"}]


@contextmanager
def serving(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture(scope="module")
def server(tiny_patched):
    """(base url, worker, model, tokenizer): one request may wait behind the running one."""
    model, tokenizer = tiny_patched
    app = create_app(model, tokenizer, MODEL, max_queue=1)
    with serving(app) as url:
        yield url, app.state.worker, model, tokenizer


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=120)


def _raw(url, body: bytes | None = None, headers=None) -> tuple[int, dict]:
    """(status, JSON body) of a plain HTTP request: what a client other than the openai package sends."""
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _idle(worker, timeout=60):
    deadline = time.monotonic() + timeout
    while worker.outstanding and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.outstanding == 0, "the server did not finish its requests"


def _greedy(model, tokenizer, ids, max_new_tokens):
    return generate(model, tokenizer, ids, Sampling(max_new_tokens=max_new_tokens)).text


def test_models_lists_the_one_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_completion_matches_local_generation(server, client):
    _, _, model, tokenizer = server
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == _greedy(model, tokenizer, chat_input_ids(tokenizer, HELLO), 6)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens == chat_input_ids(tokenizer, HELLO).shape[1]


def test_completion_stop_and_seed(server, client):
    _, _, model, tokenizer = server
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    full = _greedy(model, tokenizer, text_input_ids(tokenizer, "Once upon a time"), 10)
    assert text.choices[0].text == full
    word = full.split()[2]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stop=[word])
    assert cut.choices[0].text == full[:full.index(word)] and cut.choices[0].finish_reason == "stop"
    sampled = [client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=1.2, top_p=0.9,
                                              seed=11).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_streaming_chat_sends_the_same_text_in_chunks(server, client):
    _, _, model, tokenizer = server
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _greedy(model, tokenizer, chat_input_ids(tokenizer, HELLO), 8)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_concurrent_requests_run_one_at_a_time_and_all_answer(server, client):
    url, worker, model, tokenizer = server
    expected = _greedy(model, tokenizer, chat_input_ids(tokenizer, HELLO), 5)
    answers, before = [None] * 2, len(worker.finished)

    def ask(i):
        answers[i] = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5,
                                                    temperature=0).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == [expected, expected]
    _idle(worker)
    records = list(worker.finished)[before:]
    assert len(records) == 2 and records[0].ended <= records[1].started  # never two generations at once


def test_a_client_leaving_mid_stream_cancels_its_generation(server, client):
    _, worker, _, _ = server
    _idle(worker)
    with client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=400, temperature=0,
                                        stream=True) as stream:
        for n, _ in enumerate(stream):
            if n == 3:
                break
    _idle(worker)
    assert worker.finished[-1].finish_reason == "cancelled" and worker.finished[-1].completion_tokens < 400


def test_a_full_queue_answers_503_at_once_and_the_waiting_request_still_runs(server, client):
    _, worker, _, _ = server
    _idle(worker)
    waiting = {}
    with client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=400, temperature=0,
                                        stream=True) as running:
        next(iter(running))  # running now
        thread = threading.Thread(target=lambda: waiting.setdefault("reply", client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=3, temperature=0)))
        thread.start()
        deadline = time.monotonic() + 30
        while worker.outstanding < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.outstanding == 2
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
        assert time.monotonic() - started < 5
        assert refused.value.status_code == 503 and "the server is busy" in refused.value.message
        assert refused.value.response.headers["retry-after"] == "1"
    thread.join(timeout=120)
    assert waiting["reply"].choices[0].message.content and waiting["reply"].usage.completion_tokens == 3


HI = b'"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("body, param, fragment", [
    (b"{not json", None, "the body is not valid JSON"),  # no byte offset posing as a parameter
    (b'{"model": "tiny-llama"}', "messages", "messages: Field required"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role", "messages[0].role: Input should be"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content", "messages[0].content: "),
    (b'{"messages": []}', "messages", "messages: expected at least one message"),
    (b'{%s, "temperature": -1}' % HI, "temperature", "temperature: expected a number >= 0 (0 = greedy), got -1.0"),
    (b'{%s, "temperature": true}' % HI, "temperature", "temperature: expected a number, got True"),
    (b'{%s, "temperature": "hot"}' % HI, "temperature", "temperature: expected a number, got 'hot'"),
    (b'{%s, "top_p": 2}' % HI, "top_p", "top_p: expected a number in (0, 1]"),
    (b'{%s, "max_tokens": 0}' % HI, "max_tokens", "max_tokens: expected an int >= 1"),
    (b'{%s, "max_tokens": "5"}' % HI, "max_tokens", "max_tokens: expected an int, got '5'"),
    (b'{%s, "max_tokens": 5.0}' % HI, "max_tokens", "max_tokens: expected an int, got 5.0"),
    (b'{%s, "max_tokens": 100000}' % HI, "max_tokens", "leaves room for"),
    (b'{%s, "n": 2}' % HI, "n", "n: only 1 choice"),
    (b'{%s, "stop": [""]}' % HI, "stop", "stop: expected non-empty strings"),
    (b'{%s, "stop": 7}' % HI, "stop", "stop: expected a string or a list of strings, got 7"),
    (b'{%s, "seed": 99999999999999999999999}' % HI, "seed", "seed: expected an int in [0, 18446744073709551615]"),
    (b'{%s, "stream": "yes"}' % HI, "stream", "stream: expected a boolean"),
    (b'{%s, "stream_options": {"include_usage": 1}}' % HI, "stream_options.include_usage", "Input should be"),
    (b'{%s, "presence_penalty": 3}' % HI, "presence_penalty", "presence_penalty: expected a number in [-2, 2]"),
    (b'{%s, "logit_bias": {"abc": 1}}' % HI, "logit_bias", "logit_bias: keys must be token ids"),
    (b'{%s, "logit_bias": {"5": 200}}' % HI, "logit_bias", "logit_bias: expected token ids"),
    (b'{%s, "logit_bias": {"999999": 1}}' % HI, "logit_bias", "(the model's vocabulary), got 999999"),
    (b'{%s, "top_logprobs": 2}' % HI, "top_logprobs", "top_logprobs: needs logprobs set to true"),
    (b'{%s, "logprobs": true, "top_logprobs": 21}' % HI, "top_logprobs", "top_logprobs: expected an int in [0, 20]"),
    (b'{%s, "logprobs": 1}' % HI, "logprobs", "logprobs: expected a boolean"),
    (b'{"messages": [{"role": "user", "content": "%s"}]}' % (b"word " * 600), "messages",
     "messages: the prompt has "),
])
def test_malformed_chat_bodies_get_400_naming_the_parameter_and_the_server_goes_on(server, body, param, fragment):
    url, worker, _, _ = server
    code, answer = _raw(f"{url}/chat/completions", body)
    assert (code, answer["error"]["param"]) == (400, param) and fragment in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert worker.outstanding == 0
    assert _raw(f"{url}/models")[0] == 200


@pytest.mark.parametrize("path, body, param, fragment", [
    ("chat/completions", b'{%s, "tools": [{"type": "function", "function": {"name": "f"}}]}' % HI, "tools", ""),
    ("chat/completions", b'{%s, "response_format": {"type": "json_object"}}' % HI, "response_format", ""),
    ("chat/completions", b'{%s, "tool_choice": "auto"}' % HI, "tool_choice", ""),
    ("chat/completions", b'{%s, "temprature": 0}' % HI, "temprature", ""),
    ("completions", b'{"prompt": "hi", "echo": true}', "echo", ""),
    ("completions", b'{"prompt": "hi", "best_of": 2}', "best_of", ""),
    ("completions", b'{"prompt": "hi", "suffix": "x"}', "suffix", ""),
    ("completions", b'{"prompt": "hi", "logprobs": 6}', "logprobs", "logprobs: expected an int in [0, 5], got 6"),
    ("completions", b'{"prompt": "%s"}' % (b"word " * 600), "prompt",
     "prompt: the prompt has 601 tokens, more than the 511 that leave room for an answer in the model's context of "
     "512 tokens (config.max_position_embeddings)"),
])
def test_fields_the_server_does_not_implement_get_400_naming_them(server, path, body, param, fragment):
    code, answer = _raw(f"{server[0]}/{path}", body)
    assert (code, answer["error"]["param"]) == (400, param), answer
    assert answer["error"]["message"].startswith(fragment or f"{param}: not supported by this server")


def test_an_unknown_model_gets_404_model_not_found(server, client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="gpt-4", messages=HELLO, max_tokens=2)
    assert refused.value.code == "model_not_found" and refused.value.param == "model"
    assert "'gpt-4' does not exist: this server serves 'tiny-llama'" in refused.value.message
    code, answer = _raw(f"{server[0]}/completions", b'{"model": "gpt-4", "prompt": "hi"}')
    assert code == 404 and answer["error"]["code"] == "model_not_found"
    assert _raw(f"{server[0]}/completions", b'{"prompt": "hi", "max_tokens": 1}')[0] == 200  # no model: the one served


def test_the_client_sees_bad_parameters_as_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="top_p: expected a number in"):
        client.chat.completions.create(model=MODEL, messages=HELLO, top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        client.post("/nowhere", cast_to=object)


def test_an_api_key_is_required_when_set(tiny_patched):
    model, tokenizer = tiny_patched
    with serving(create_app(model, tokenizer, MODEL, api_key="s3cret")) as url:
        with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert _raw(f"{url}/models") == (401, {"error": {"message": "missing or wrong API key: send 'Authorization: "
                                                     "Bearer <key>'", "type": "authentication_error",
                                                     "param": None, "code": None}})
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list()] == [MODEL]
        assert good.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).usage.completion_tokens == 2


def test_a_client_giving_up_on_a_plain_request_cancels_it(server):
    import socket
    from urllib.parse import urlsplit

    url, worker, _, _ = server
    _idle(worker)
    where = urlsplit(url)
    body = json.dumps({"messages": HELLO, "max_tokens": 400, "temperature": 0}).encode()
    with socket.create_connection((where.hostname, where.port)) as connection:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while worker.outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # generating now
    _idle(worker)
    assert worker.finished[-1].finish_reason == "cancelled" and worker.finished[-1].completion_tokens < 400


def test_a_failing_generation_gets_500_and_the_server_goes_on(tiny_patched):
    model, tokenizer = tiny_patched

    class Failing:
        config, generation_config = model.config, model.generation_config

        def generate(self, **kwargs):
            raise RuntimeError("the NPU fell over")

    with serving(create_app(Failing(), tokenizer, MODEL)) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="generation failed: RuntimeError: the NPU fell over"):
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, stream=True)
        with pytest.raises(openai.APIError, match="the NPU fell over"):
            list(stream)
        assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_logprobs_plain_and_streamed_are_the_generations_own(server, client):
    _, _, model, tokenizer = server
    expected = generate(model, tokenizer, chat_input_ids(tokenizer, HELLO), Sampling(max_new_tokens=6, logprobs=2))
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [(c.token, c.logprob, bytes(c.bytes)) for c in content] == [(e.text, e.logprob, e.bytes)
                                                                       for e in expected.logprobs]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [[(text, lp) for text, _, lp in e.top]
                                                                                 for e in expected.logprobs]
    assert "".join(c.token for c in content) == reply.choices[0].message.content == expected.text
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True)
    streamed = [(c.choices[0].delta.content or "", c.choices[0].logprobs) for c in stream if c.choices]
    # each chunk carries the tokens whose text starts in it
    assert "".join(text for text, _ in streamed) == expected.text
    assert [(e.token, e.logprob) for _, logprobs in streamed if logprobs is not None
            for e in logprobs.content] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_take_the_legacy_shape(server, client):
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=3)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text and len(logprobs.tokens) == 5
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(5)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == logprob == max(top.values())  # greedy: the likeliest
        assert logprob <= 0


def test_penalties_and_logit_bias_reach_the_generation(server, client):
    _, _, model, tokenizer = server
    sampling = Sampling(max_new_tokens=8, presence_penalty=1.0, frequency_penalty=1.5)
    expected = generate(model, tokenizer, chat_input_ids(tokenizer, HELLO), sampling).text
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0,
                                           presence_penalty=1.0, frequency_penalty=1.5)
    assert reply.choices[0].message.content == expected
    blue = tokenizer.convert_tokens_to_ids("Ġblue")
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={str(blue): 100})
    assert forced.choices[0].text == " blue" * 3


def test_a_dozen_concurrent_default_clients_all_get_answers(tiny_patched):
    """The openai client's defaults (2 retries of a 503, about 1 s apart as Retry-After says): the default queue
    absorbs 12 requests at once, each taking 1.2 s (with a queue of 8, requests still raised 503 after their
    retries)."""
    model, tokenizer = tiny_patched
    expected = _greedy(model, tokenizer, chat_input_ids(tokenizer, HELLO), 3)

    class Slow:
        config, generation_config = model.config, model.generation_config

        def generate(self, **kwargs):
            time.sleep(1.2)
            return model.generate(**kwargs)

    with serving(create_app(Slow(), tokenizer, MODEL)) as url:
        answers, errors = [], []

        def ask():
            try:
                answers.append(openai.OpenAI(base_url=url, api_key="unused").chat.completions.create(
                    model=MODEL, messages=HELLO, max_tokens=3, temperature=0).choices[0].message.content)
            except openai.APIError as error:
                errors.append(error)

        threads = [threading.Thread(target=ask) for _ in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    assert errors == [] and answers == [expected] * 12


def test_a_request_that_extends_the_previous_one_prefills_only_its_new_tokens(server, client):
    _, worker, model, tokenizer = server
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    ids = chat_input_ids(tokenizer, follow)
    cached = worker.conversation.reusable(ids)
    assert cached > chat_input_ids(tokenizer, HELLO).shape[1]
    second = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=5, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == cached
    assert second.usage.prompt_tokens == ids.shape[1]
    assert second.choices[0].message.content == _greedy(model, tokenizer, ids, 5)  # a fresh run's answer
    again = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # the same prompt again is not an extension
