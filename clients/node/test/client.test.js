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
