#!/usr/bin/env node
'use strict';
/**
 * Example CLI for the protoserve Node client: one unary Generate, one
 * GenerateStream printed as it arrives, and one call that fails on purpose
 * (max_tokens: -1) to show the INVALID_ARGUMENT status and its decoded details.
 *
 * Usage: node clients/node/client.js [--target host:port] [--max-tokens N] [prompt...]
 * The target defaults to $PROTOSERVE_GRPC_TARGET, then localhost:50051;
 * $PROTOSERVE_API_KEY and $PROTOSERVE_USER_ID are sent when set.
 */

const { parseArgs } = require('node:util');
const { ProtoserveClient, ProtoserveError, DEFAULT_TARGET } = require('./index');

async function main() {
  const { values, positionals } = parseArgs({
    options: {
      target: { type: 'string', default: process.env.PROTOSERVE_GRPC_TARGET || DEFAULT_TARGET },
      'max-tokens': { type: 'string', default: '16' },
    },
    allowPositionals: true,
  });
  const prompt = positionals.join(' ') || 'The capital of France is';
  const sampling = { max_tokens: Number(values['max-tokens']), temperature: 0 };
  const client = new ProtoserveClient(values.target, {
    apiKey: process.env.PROTOSERVE_API_KEY,
    userId: process.env.PROTOSERVE_USER_ID,
    timeoutMs: 60_000,
  });
  try {
    // Right after `make run` the model may still be loading.
    await client.waitUntilReady(120_000);
    const response = await client.generate({ prompt, sampling });
    const choice = response.choices[0];
    console.log(`[generate] ${JSON.stringify(choice.text)} (${choice.finish_reason}, ` +
      `${response.usage.completion_tokens} tokens, model ${response.model})`);

    process.stdout.write('[stream] ');
    for await (const message of client.stream({ prompt, sampling })) {
      if (message.event === 'delta') {
        process.stdout.write(message.delta.text);
      } else {
        const finish = message.final.choices.map((c) => c.finish_reason).join(',');
        process.stdout.write(`\n[stream] final: ${finish}, ${message.final.usage.completion_tokens} tokens\n`);
      }
    }

    try {
      await client.generate({ prompt, sampling: { max_tokens: -1 } });
      console.error('[error] expected INVALID_ARGUMENT, but the call succeeded');
      return 1;
    } catch (err) {
      if (!(err instanceof ProtoserveError)) throw err;
      const fields = err.fieldViolations.map((v) => `${v.field}: ${v.description}`).join('; ');
      console.log(`[error] ${err.codeName} reason=${err.reason} violations=[${fields}]`);
    }
    return 0;
  } finally {
    client.close();
  }
}

main().then(
  (code) => { process.exitCode = code; },
  (err) => {
    console.error(err instanceof ProtoserveError ? `${err.message} ${JSON.stringify(err.details)}` : err);
    process.exitCode = 1;
  },
);
