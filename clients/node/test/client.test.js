'use strict';
/**
 * The Node client against a running protoserve server (node --test clients/node/test/).
 *
 * The server address comes from $PROTOSERVE_GRPC_TARGET (tests/clients/test_node_client.py
 * starts a live server and sets it); $PROTOSERVE_API_KEY is sent when set.
 * Without a target every test is skipped, so the reason is visible in the output.
 */

const net = require('node:net');
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { execFile } = require('node:child_process');
const { promisify } = require('node:util');
const { ProtoserveClient, ProtoserveError, grpc } = require('..');

const target = process.env.PROTOSERVE_GRPC_TARGET;
const skip = target ? false : 'PROTOSERVE_GRPC_TARGET is not set';
const PROMPT = 'The capital of France is';
const GREEDY = { max_tokens: 4, temperature: 0 };
// Long enough to outlive every deadline and early exit below.
const ENDLESS = { max_tokens: 512, ignore_eos: true };

let client;
before(async () => {
  if (!target) return;
  client = new ProtoserveClient(target, { apiKey: process.env.PROTOSERVE_API_KEY, timeoutMs: 60_000 });
  await client.waitUntilReady(60_000);
});
after(() => client && client.close());

test('health reports SERVING with the loaded models', { skip }, async () => {
  const health = await client.health();
  assert.equal(health.status, 'SERVING_STATUS_SERVING');
  assert.ok(health.models.length >= 1);
  const { models } = await client.listModels();
  assert.equal(models[0].name, health.models[0]);
});

test('waitUntilReady gives up on an address nobody listens on with UNAVAILABLE', async () => {
  const port = await new Promise((resolve) => {
    const probe = net.createServer().listen(0, '127.0.0.1', () => {
      const { port: free } = probe.address();
      probe.close(() => resolve(free));
    });
  });
  const nobody = new ProtoserveClient(`127.0.0.1:${port}`);
  try {
    await assert.rejects(nobody.waitUntilReady(500, 50), (err) => {
      assert.ok(err instanceof ProtoserveError);
      assert.equal(err.code, grpc.status.UNAVAILABLE);
      return true;
    });
  } finally {
    nobody.close();
  }
});

test('unary Generate returns the choice, usage and stats', { skip }, async () => {
  const response = await client.generate({ request_id: 'node-unary', prompt: PROMPT, sampling: GREEDY });
  assert.equal(response.request_id, 'node-unary');
  assert.equal(response.choices.length, 1);
  const choice = response.choices[0];
  assert.ok(choice.text.length > 0);
  assert.ok(['FINISH_REASON_LENGTH', 'FINISH_REASON_STOP'].includes(choice.finish_reason));
  assert.equal(response.usage.completion_tokens, choice.token_ids.length);
  assert.ok(response.usage.prompt_tokens > 0);
  assert.ok(response.stats.e2e_time_s > 0);
});

test('GenerateStream yields deltas, then one final, matching the unary text', { skip }, async () => {
  const unary = await client.generate({ prompt: PROMPT, sampling: GREEDY });
  const messages = [];
  for await (const message of client.stream({ request_id: 'node-stream', prompt: PROMPT, sampling: GREEDY })) {
    messages.push(message);
  }
  const deltas = messages.filter((m) => m.event === 'delta');
  const finals = messages.filter((m) => m.event === 'final');
  assert.ok(deltas.length >= 1);
  assert.equal(finals.length, 1);
  assert.equal(messages.at(-1).event, 'final');
  assert.ok(messages.every((m) => m.request_id === 'node-stream'));
  // Greedy decoding is deterministic, so the streamed pieces add up to the unary text.
  assert.equal(deltas.map((m) => m.delta.text).join(''), unary.choices[0].text);
  assert.equal(finals[0].final.usage.completion_tokens, unary.usage.completion_tokens);
});

test('breaking out of a stream early cancels it without an error', { skip }, async () => {
  let seen = 0;
  for await (const message of client.stream({ prompt: PROMPT, sampling: ENDLESS })) {
    if (message.event === 'delta') seen += 1;
    if (seen === 2) break;
  }
  assert.equal(seen, 2);
});

test('max_tokens: -1 fails with INVALID_ARGUMENT and decoded BadRequest/ErrorInfo details', { skip }, async () => {
  await assert.rejects(client.generate({ prompt: PROMPT, sampling: { max_tokens: -1 } }), (err) => {
    assert.ok(err instanceof ProtoserveError);
    assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
    assert.equal(err.codeName, 'INVALID_ARGUMENT');
    assert.equal(err.reason, 'INVALID_PARAMETER');
    assert.equal(err.domain, 'protoserve');
    assert.ok(err.fieldViolations.some((v) => v.field.endsWith('max_tokens')), JSON.stringify(err.details));
    return true;
  });
});

test('an unknown model fails with NOT_FOUND (MODEL_NOT_FOUND), in a stream too', { skip }, async () => {
  await assert.rejects(client.getModel('no-such-model'), (err) => {
    assert.equal(err.code, grpc.status.NOT_FOUND);
    return true;
  });
  await assert.rejects(
    (async () => {
      for await (const _ of client.stream({ model: 'no-such-model', prompt: PROMPT, sampling: GREEDY })) {
        // nothing arrives before the error
      }
    })(),
    (err) => {
      assert.ok(err instanceof ProtoserveError);
      assert.equal(err.code, grpc.status.NOT_FOUND);
      assert.equal(err.reason, 'MODEL_NOT_FOUND');
      return true;
    },
  );
});

test('Batch returns per-request results and errors; tokenize round-trips', { skip }, async () => {
  const { results } = await client.batch([
    { prompt: PROMPT, sampling: { max_tokens: 1 } },
    { prompt: PROMPT, sampling: { max_tokens: -1 } },
  ]);
  assert.equal(results.length, 2);
  assert.equal(results[0].result, 'response');
  assert.equal(results[1].result, 'error');
  const err = client.errorFromStatus(results[1].error);
  assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
  assert.equal(err.reason, 'INVALID_PARAMETER');

  const tokens = await client.tokenize({ text: 'Hello world' });
  assert.equal(tokens.token_ids.length, tokens.tokens.length);
  const { text } = await client.detokenize({ token_ids: tokens.token_ids });
  assert.equal(text, 'Hello world');
});

test('a deadline that passes fails with DEADLINE_EXCEEDED', { skip }, async () => {
  const request = { prompt: PROMPT, sampling: ENDLESS };
  await assert.rejects(client.generate(request, { timeoutMs: 200 }), (err) => {
    assert.equal(err.code, grpc.status.DEADLINE_EXCEEDED);
    return true;
  });
});

const authSkip = skip || (!process.env.PROTOSERVE_API_KEY && 'PROTOSERVE_API_KEY is not set (auth off)');
test('a wrong API key is UNAUTHENTICATED', { skip: authSkip }, async () => {
  const stranger = new ProtoserveClient(target, { apiKey: 'wrong-key', timeoutMs: 30_000 });
  try {
    await assert.rejects(stranger.listModels(), (err) => {
      assert.equal(err.code, grpc.status.UNAUTHENTICATED);
      assert.equal(err.reason, 'UNAUTHENTICATED');
      return true;
    });
  } finally {
    stranger.close();
  }
});

// --- embeddings, RAG and agent runs ---------------------------------------------

const EMBEDDING_DIMENSIONS = 384; // all-MiniLM-L6-v2, the server's default embedding model
const DOCUMENTS = [
  {
    document_id: 'volcanoes',
    text: 'Mount Etna is an active volcano on the east coast of Sicily. Its eruptions send lava down its slopes.',
    metadata: { topic: 'geology' },
  },
  {
    document_id: 'bread',
    text: 'Sourdough bread rises because wild yeast and lactic acid bacteria ferment the dough for hours.',
    metadata: { topic: 'cooking' },
  },
];
const QUESTION = 'Which volcano is on the coast of Sicily?';
const RAG_GREEDY = { max_tokens: 8, temperature: 0 };

/** A client of a user id no other test uses: RAG documents belong to the caller, so its documents are its own. */
function userClient() {
  const userId = `node-${Math.random().toString(16).slice(2, 14)}`;
  return new ProtoserveClient(target, { apiKey: process.env.PROTOSERVE_API_KEY, userId, timeoutMs: 60_000 });
}

async function collect(iterable) {
  const out = [];
  for await (const item of iterable) out.push(item);
  return out;
}

function assertInvalidField(err, field) {
  assert.ok(err instanceof ProtoserveError, String(err));
  assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
  assert.equal(err.reason, 'INVALID_PARAMETER');
  assert.deepEqual(err.fieldViolations.map((v) => v.field), [field]);
  return true;
}

test('embed returns one unit vector of 384 dimensions per text, in order', { skip }, async () => {
  const response = await client.embed({ texts: ['A cat sits on the mat.', 'A kitten is on a rug.', 'Rates rose.'] });
  assert.equal(response.dimensions, EMBEDDING_DIMENSIONS);
  assert.deepEqual(response.embeddings.map((e) => e.index), [0, 1, 2]);
  for (const { values } of response.embeddings) {
    assert.equal(values.length, EMBEDDING_DIMENSIONS);
    assert.ok(Math.abs(Math.hypot(...values) - 1) < 1e-4);
  }
  const dot = (a, b) => a.reduce((sum, x, i) => sum + x * b[i], 0);
  const [cat, kitten, rates] = response.embeddings.map((e) => e.values);
  assert.ok(dot(cat, kitten) > dot(cat, rates) + 0.2);
  assert.ok(response.usage.prompt_tokens > 3);
});

test('documents: index, search finds them, get, list by pages, delete', { skip }, async () => {
  const rag = userClient();
  const stranger = userClient();
  try {
    const { documents: indexed } = await rag.indexDocuments({ documents: DOCUMENTS });
    assert.deepEqual(indexed.map((d) => [d.document_id, d.chunks, d.replaced]), [['volcanoes', 1, false], ['bread', 1, false]]);
    const again = await rag.indexDocuments({ documents: [DOCUMENTS[1]], chunking: { chunk_tokens: 64, overlap_tokens: 8 } });
    assert.equal(again.documents[0].replaced, true);

    const { chunks } = await rag.searchDocuments({ query: QUESTION, top_k: 2 });
    assert.deepEqual(chunks.map((c) => c.document_id), ['volcanoes', 'bread']);
    assert.ok(chunks[0].score > chunks[1].score);
    assert.equal(chunks[0].text, DOCUMENTS[0].text.slice(chunks[0].start, chunks[0].end));
    assert.deepEqual(chunks[0].metadata, { topic: 'geology' });
    const filtered = await rag.searchDocuments({ query: QUESTION, filter: { topic: 'cooking' } });
    assert.deepEqual(filtered.chunks.map((c) => c.document_id), ['bread']);

    const stored = await rag.getDocument('volcanoes');
    assert.equal(stored.text, DOCUMENTS[0].text);
    assert.equal(stored.document.bytes, String(Buffer.byteLength(DOCUMENTS[0].text))); // int64 as a string
    assert.equal(stored.chunks.length, 1);

    const page = await rag.listDocuments({ page_size: 1 });
    assert.deepEqual(page.documents.map((d) => d.document_id), ['volcanoes']);
    assert.ok(page.next_page_token);
    const all = await collect(rag.iterDocuments({ page_size: 1 }));
    assert.deepEqual(all.map((d) => d.document_id), ['volcanoes', 'bread']);

    assert.deepEqual((await stranger.searchDocuments({ query: QUESTION })).chunks, []);
    await assert.rejects(stranger.getDocument('volcanoes'), (err) => {
      assert.equal(err.code, grpc.status.NOT_FOUND);
      assert.equal(err.reason, 'DOCUMENT_NOT_FOUND');
      return true;
    });

    const deleted = await rag.deleteDocuments(['volcanoes', 'never-indexed']);
    assert.deepEqual(deleted, { deleted: ['volcanoes'], not_found: ['never-indexed'] });
    assert.deepEqual((await collect(rag.iterDocuments())).map((d) => d.document_id), ['bread']);
    assert.throws(() => rag.deleteDocuments('bread'), TypeError);
  } finally {
    rag.close();
    stranger.close();
  }
});

test('top_k: 0 fails with INVALID_ARGUMENT naming top_k, in a stream too', { skip }, async () => {
  await assert.rejects(client.searchDocuments({ query: QUESTION, top_k: 0 }), (err) => assertInvalidField(err, 'top_k'));
  await assert.rejects(
    collect(client.retrieveAndGenerateStream({ query: QUESTION, top_k: 0, sampling: RAG_GREEDY })),
    (err) => assertInvalidField(err, 'top_k'),
  );
});

test('retrieveAndGenerate cites its chunks; the stream sends citations first and final last', { skip }, async () => {
  const rag = userClient();
  try {
    await rag.indexDocuments({ documents: DOCUMENTS });
    const answer = await rag.retrieveAndGenerate({ query: QUESTION, top_k: 1, sampling: RAG_GREEDY });
    assert.ok(answer.answer.length > 0);
    assert.ok(['FINISH_REASON_LENGTH', 'FINISH_REASON_STOP'].includes(answer.finish_reason));
    assert.ok(answer.usage.completion_tokens <= RAG_GREEDY.max_tokens);
    assert.equal(answer.citations.length, 1);
    assert.equal(answer.citations[0].number, 1);
    assert.equal(answer.citations[0].chunk.document_id, 'volcanoes');

    const events = await collect(rag.retrieveAndGenerateStream({ query: QUESTION, top_k: 2, sampling: RAG_GREEDY }));
    assert.equal(events[0].event, 'citations');
    assert.deepEqual(events[0].citations.citations.map((c) => c.chunk.document_id), ['volcanoes', 'bread']);
    assert.equal(events.at(-1).event, 'final');
    assert.ok(events.length > 2 && events.slice(1, -1).every((e) => e.event === 'text'));
    assert.equal(new Set(events.map((e) => e.request_id)).size, 1);
    assert.ok(events.at(-1).final.usage.completion_tokens <= RAG_GREEDY.max_tokens);
  } finally {
    rag.close();
  }
});

test('runAgent calls the calculator and ends with an answer; listTools gives plain JSON Schema', { skip }, async () => {
  const { tools } = await client.listTools();
  const calculator = tools.find((t) => t.name === 'calculator');
  assert.ok(calculator && calculator.description);
  assert.equal(calculator.parameters.type, 'object');

  const events = await collect(client.runAgent({
    messages: [{ role: 'user', content: 'Use the calculator to compute 17*23.' }],
    tools: ['calculator'],
    tool_choice: 'required',
    max_steps: 2,
    sampling: { temperature: 0, max_tokens: 60 },
  }));
  const last = events.at(-1);
  assert.equal(last.event, 'answer');
  assert.equal(events.filter((e) => e.event === 'answer').length, 1);
  assert.ok(['AGENT_STOP_REASON_ANSWERED', 'AGENT_STOP_REASON_MAX_STEPS'].includes(last.answer.stop_reason));
  assert.ok(last.answer.steps <= 2);
  assert.ok(last.run_id.startsWith('run-') && events.every((e) => e.run_id === last.run_id));
  const call = events.find((e) => e.event === 'tool_call');
  assert.equal(call.step, 1);
  assert.equal(call.tool_call.name, 'calculator');
  const result = events.find((e) => e.event === 'tool_result' && e.tool_result.id === call.tool_call.id);
  assert.ok(result, JSON.stringify(events));
  // Greedy decoding makes this the model's call every time, so the tool really ran.
  assert.equal(result.tool_result.content, '391');
  assert.equal(result.tool_result.is_error, false);
});

test('the example CLI runs generate, stream and the error demo', { skip }, async () => {
  const cli = path.join(__dirname, '..', 'client.js');
  // The CLI reads the key from the environment, as this suite does.
  const { stdout } = await promisify(execFile)(process.execPath, [cli, '--target', target, '--max-tokens', '2'], {
    timeout: 60_000,
  });
  assert.match(stdout, /^\[generate\] /m);
  assert.match(stdout, /^\[stream\] final: FINISH_REASON_/m);
  assert.match(stdout, /^\[error\] INVALID_ARGUMENT reason=INVALID_PARAMETER/m);
});
