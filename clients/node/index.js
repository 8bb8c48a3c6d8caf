'use strict';
/**
 * Node client for protoserve's gRPC API: InferenceService, EmbeddingService,
 * RagService and AgentService (package protoserve.v1).
 *
 * The service definitions are loaded at run time from the repo's .proto files
 * with @grpc/proto-loader (keepCase: true, so fields keep their proto names:
 * `max_tokens`, `request_id`, ...). Messages are plain objects shaped like the
 * proto; see proto/protoserve/v1/{inference,embeddings,rag,agent}.proto.
 *
 * Failed calls reject (or throw from the stream iterator) with a
 * ProtoserveError that carries the gRPC code and the decoded google.rpc.Status
 * details (ErrorInfo reason, BadRequest field violations, RetryInfo delay).
 */

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
// protobufjs is what @grpc/proto-loader itself parses protos with; resolving it
// through proto-loader uses that copy, so no dependency is added. It decodes
// the google.rpc.Status in `grpc-status-details-bin`, which grpc-js leaves as bytes.
const protobuf = require(require.resolve('protobufjs', { paths: [require.resolve('@grpc/proto-loader')] }));

/** Repo root holding proto/ and third_party/googleapis/ (override with PROTOSERVE_PROTO_ROOT). */
const DEFAULT_PROTO_ROOT = process.env.PROTOSERVE_PROTO_ROOT || path.resolve(__dirname, '..', '..');
const DEFAULT_TARGET = 'localhost:50051';
const STATUS_DETAILS_KEY = 'grpc-status-details-bin';
// What waitUntilReady treats as "not yet": UNAVAILABLE while the server starts,
// loads its model or drains; DEADLINE_EXCEEDED when one probe outlives its
// short deadline on a busy machine.
const NOT_READY_CODES = new Set([grpc.status.UNAVAILABLE, grpc.status.DEADLINE_EXCEEDED]);
const PROBE_TIMEOUT_MS = 5_000;

/** Options for turning messages into plain objects: names as in the proto, enums as names, int64 as strings. */
const LOADER_OPTIONS = Object.freeze({
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});

/** The proto files whose services the client calls, relative to proto/. */
const SERVICE_PROTOS = Object.freeze([
  'protoserve/v1/inference.proto',
  'protoserve/v1/embeddings.proto',
  'protoserve/v1/rag.proto',
  'protoserve/v1/agent.proto',
]);

const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, code]) => [code, name]));

/**
 * Load the service definitions and the google.rpc detail types.
 * @param {string} [protoRoot] repo root with proto/ and third_party/googleapis/
 * @returns {{InferenceService: grpc.ServiceClientConstructor, EmbeddingService: grpc.ServiceClientConstructor,
 *   RagService: grpc.ServiceClientConstructor, AgentService: grpc.ServiceClientConstructor,
 *   errorTypes: protobuf.Root}}
 */
function loadProtos(protoRoot = DEFAULT_PROTO_ROOT) {
  const includeDirs = [path.join(protoRoot, 'proto'), path.join(protoRoot, 'third_party', 'googleapis')];
  const definition = protoLoader.loadSync([...SERVICE_PROTOS], { ...LOADER_OPTIONS, includeDirs });
  const v1 = grpc.loadPackageDefinition(definition).protoserve.v1;
  const { InferenceService, EmbeddingService, RagService, AgentService } = v1;

  const errorTypes = new protobuf.Root();
  // Resolve imports against the same include dirs as proto-loader does.
  errorTypes.resolvePath = (_origin, target) => {
    const dir = includeDirs.find((d) => fs.existsSync(path.join(d, target)));
    return dir ? path.join(dir, target) : target;
  };
  errorTypes.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
  return { InferenceService, EmbeddingService, RagService, AgentService, errorTypes };
}

/**
 * A google.protobuf.Value as proto-loader decodes it ({kind: 'numberValue', numberValue: 1, ...}) as plain JSON.
 * @param {object} value
 */
function valueToJson(value) {
  switch (value.kind) {
    case 'nullValue': return null;
    case 'numberValue': return value.numberValue;
    case 'stringValue': return value.stringValue;
    case 'boolValue': return value.boolValue;
    case 'structValue': return structToJson(value.structValue);
    case 'listValue': return (value.listValue.values || []).map(valueToJson);
    default: throw new TypeError(`google.protobuf.Value of unknown kind ${JSON.stringify(value.kind)}`);
  }
}

/**
 * A google.protobuf.Struct as proto-loader decodes it ({fields: {...}}) as a plain JSON object.
 * @param {{fields?: object}} struct
 */
function structToJson(struct) {
  return Object.fromEntries(Object.entries((struct && struct.fields) || {}).map(([k, v]) => [k, valueToJson(v)]));
}

/** A failed call: gRPC code, message and the decoded google.rpc.Status details. */
class ProtoserveError extends Error {
  /**
   * @param {number} code gRPC status code (grpc.status.*)
   * @param {string} message status message
   * @param {Array<object>} details decoded details, each with its `@type` name
   */
  constructor(code, message, details = []) {
    super(`${CODE_NAMES[code] || code}: ${message}`);
    this.name = 'ProtoserveError';
    this.code = code;
    this.codeName = CODE_NAMES[code] || String(code);
    this.statusMessage = message;
    this.details = details;
    const info = details.find((d) => d['@type'] === 'google.rpc.ErrorInfo');
    /** ErrorInfo.reason, such as "INVALID_PARAMETER" or "MODEL_NOT_FOUND". */
    this.reason = info ? info.reason : undefined;
    this.domain = info ? info.domain : undefined;
    this.errorMetadata = info ? info.metadata : {};
    /** BadRequest field violations: [{field, description}]. */
    this.fieldViolations = details
      .filter((d) => d['@type'] === 'google.rpc.BadRequest')
      .flatMap((d) => d.field_violations);
    const retry = details.find((d) => d['@type'] === 'google.rpc.RetryInfo');
    /** RetryInfo delay in seconds, when the server says when to retry. */
    this.retryDelaySeconds = retry && retry.retry_delay
      ? Number(retry.retry_delay.seconds || 0) + (retry.retry_delay.nanos || 0) / 1e9
      : undefined;
  }
}

/**
 * Decode a google.rpc.Status message (bytes or an already decoded object) into its details.
 * @param {protobuf.Root} errorTypes
 * @param {{details?: Array<{type_url: string, value: Uint8Array}>}} status
 */
function decodeDetails(errorTypes, status) {
  return (status.details || []).map((any) => {
    const typeName = any.type_url.slice(any.type_url.lastIndexOf('/') + 1);
    let type;
    try {
      type = errorTypes.lookupType(typeName);
    } catch {
      return { '@type': typeName, value: Buffer.from(any.value) };
    }
    const object = type.toObject(type.decode(any.value), { longs: String, enums: String, defaults: true });
    return { '@type': typeName, ...object };
  });
}

/** Convert a grpc-js ServiceError into a ProtoserveError. */
function toProtoserveError(errorTypes, err) {
  if (err instanceof ProtoserveError || typeof err.code !== 'number') return err;
  let details = [];
  const raw = err.metadata ? err.metadata.get(STATUS_DETAILS_KEY) : [];
  if (raw.length > 0) {
    const Status = errorTypes.lookupType('google.rpc.Status');
    details = decodeDetails(errorTypes, Status.decode(raw[0]));
  }
  return new ProtoserveError(err.code, err.details || '', details);
}

/**
 * Client for protoserve's gRPC services (inference, embeddings, RAG, agent runs); every method takes and
 * returns plain proto-shaped objects.
 */
class ProtoserveClient {
  /**
   * @param {string} [target] host:port of the gRPC server
   * @param {object} [options]
   * @param {string} [options.apiKey] sent as `authorization: Bearer <key>`
   * @param {string} [options.userId] sent as `x-user-id`; the server scopes Cancel by it
   * @param {number} [options.timeoutMs] default deadline of every call
   * @param {grpc.ChannelCredentials} [options.credentials] TLS credentials; plaintext by default
   * @param {string} [options.protoRoot] repo root with proto/ and third_party/googleapis/
   */
  constructor(target = DEFAULT_TARGET, options = {}) {
    const services = loadProtos(options.protoRoot);
    this.errorTypes = services.errorTypes;
    const credentials = options.credentials || grpc.credentials.createInsecure();
    this.stub = new services.InferenceService(target, credentials);
    // The other services share the inference stub's channel: one connection for everything.
    const shared = { channelOverride: this.stub.getChannel() };
    this.embeddingStub = new services.EmbeddingService(target, credentials, shared);
    this.ragStub = new services.RagService(target, credentials, shared);
    this.agentStub = new services.AgentService(target, credentials, shared);
    this.timeoutMs = options.timeoutMs;
    this.metadata = new grpc.Metadata();
    if (options.apiKey) this.metadata.set('authorization', `Bearer ${options.apiKey}`);
    if (options.userId) this.metadata.set('x-user-id', options.userId);
  }

  /** Metadata and deadline of one call; `callOptions.timeoutMs` overrides the client default. */
  _callArgs(callOptions = {}) {
    const metadata = this.metadata.clone();
    for (const [key, value] of Object.entries(callOptions.metadata || {})) metadata.set(key, value);
    const timeoutMs = callOptions.timeoutMs ?? this.timeoutMs;
    return [metadata, timeoutMs === undefined ? {} : { deadline: new Date(Date.now() + timeoutMs) }];
  }

  _unary(method, request, callOptions, stub = this.stub) {
    const [metadata, options] = this._callArgs(callOptions);
    return new Promise((resolve, reject) => {
      stub[method](request, metadata, options, (err, response) => {
        if (err) reject(toProtoserveError(this.errorTypes, err));
        else resolve(response);
      });
    });
  }

  /** Yield a server-streaming call's messages; errors become ProtoserveError, leaving early cancels it. */
  async *_serverStream(stub, method, request, callOptions) {
    const [metadata, options] = this._callArgs(callOptions);
    const call = stub[method](request, metadata, options);
    try {
      for await (const message of call) yield message;
    } catch (err) {
      throw toProtoserveError(this.errorTypes, err);
    } finally {
      // Leaving early (break, an exception in the loop body) must not leave
      // the server working for nobody. cancel() after the end is a no-op.
      call.cancel();
    }
  }

  /**
   * Run one request to completion.
   * @param {object} request a GenerateRequest, e.g. {prompt: 'Hi', sampling: {max_tokens: 8}}
   * @returns {Promise<object>} the GenerateResponse
   */
  generate(request, callOptions) {
    return this._unary('Generate', request, callOptions);
  }

  /**
   * Stream a generation: yields GenerateStreamResponse objects, deltas (`event === 'delta'`) then the final.
   * Breaking out of the loop cancels the call.
   * @param {object} request a GenerateRequest
   */
  stream(request, callOptions) {
    return this._serverStream(this.stub, 'GenerateStream', { request }, callOptions);
  }

  /** Stop the caller's running or queued request; resolves to {cancelled}. */
  cancel(requestId, callOptions) {
    return this._unary('Cancel', { request_id: requestId }, callOptions);
  }

  /** Run GenerateRequests concurrently; resolves to {results: [{result: 'response'|'error', ...}]}. */
  batch(requests, callOptions) {
    return this._unary('Batch', { requests }, callOptions);
  }

  /** Tokenize a TokenizeRequest ({text} or {chat}). */
  tokenize(request, callOptions) {
    return this._unary('Tokenize', request, callOptions);
  }

  /** Detokenize a DetokenizeRequest ({token_ids}). */
  detokenize(request, callOptions) {
    return this._unary('Detokenize', request, callOptions);
  }

  /** Every loaded model; the first is the default. */
  listModels(callOptions) {
    return this._unary('ListModels', {}, callOptions);
  }

  /** One loaded model by name (NOT_FOUND when not loaded). */
  getModel(name, callOptions) {
    return this._unary('GetModel', { name }, callOptions);
  }

  /** Readiness; rejects with UNAVAILABLE while the model loads or the server drains. */
  health(callOptions) {
    return this._unary('CheckHealth', {}, callOptions);
  }

  /**
   * Embed texts or token ids with the server's embedding model.
   * @param {object} request an EmbedRequest: {texts: [...]} or {token_ids: [{ids: [...]}, ...]}
   * @returns {Promise<object>} the EmbedResponse: {model, dimensions, embeddings: [{index, values}], usage}
   */
  embed(request, callOptions) {
    return this._unary('Embed', request, callOptions, this.embeddingStub);
  }

  /**
   * Chunk, embed and store the caller's documents; an id indexed again is replaced.
   * @param {object} request {documents: [{document_id, text, metadata?}], chunking?: {chunk_tokens, overlap_tokens}}
   * @returns {Promise<object>} {documents: [{document_id, chunks, tokens, replaced}]}
   */
  indexDocuments(request, callOptions) {
    return this._unary('IndexDocuments', request, callOptions, this.ragStub);
  }

  /**
   * The caller's chunks most similar to a query, best first.
   * @param {object} request {query, top_k?, filter?, min_score?}
   * @returns {Promise<object>} {chunks: [ChunkHit], usage}
   */
  searchDocuments(request, callOptions) {
    return this._unary('SearchDocuments', request, callOptions, this.ragStub);
  }

  /**
   * One page of the caller's documents, oldest first.
   * @param {object} [request] {page_size?, page_token?}
   * @returns {Promise<object>} {documents: [DocumentInfo], next_page_token} (empty token on the last page)
   */
  listDocuments(request = {}, callOptions) {
    return this._unary('ListDocuments', request, callOptions, this.ragStub);
  }

  /**
   * Every document of the caller (DocumentInfo objects), oldest first, fetching pages as it goes.
   * @param {object} [request] {page_size?}
   */
  async *iterDocuments(request = {}, callOptions) {
    let pageToken = '';
    do {
      const page = await this.listDocuments({ ...request, page_token: pageToken }, callOptions);
      yield* page.documents;
      pageToken = page.next_page_token;
    } while (pageToken);
  }

  /** One of the caller's documents: {document, text, chunks}; NOT_FOUND (DOCUMENT_NOT_FOUND) when missing. */
  getDocument(documentId, callOptions) {
    return this._unary('GetDocument', { document_id: documentId }, callOptions, this.ragStub);
  }

  /** Remove the caller's documents by id; resolves to {deleted, not_found}. */
  deleteDocuments(documentIds, callOptions) {
    if (!Array.isArray(documentIds)) throw new TypeError('documentIds must be an array of document ids');
    return this._unary('DeleteDocuments', { document_ids: documentIds }, callOptions, this.ragStub);
  }

  /**
   * Answer a question from the caller's documents.
   * @param {object} request a RetrieveAndGenerateRequest: {query, top_k?, filter?, min_score?, system_prompt?,
   *   sampling?}
   * @returns {Promise<object>} {request_id, model, answer, citations: [{number, chunk}], finish_reason, usage}
   */
  retrieveAndGenerate(request, callOptions) {
    return this._unary('RetrieveAndGenerate', request, callOptions, this.ragStub);
  }

  /**
   * Stream an answer: yields RetrieveAndGenerateStreamResponse objects, `event` 'citations' first, then 'text'
   * deltas, then 'final'. Breaking out of the loop cancels the call.
   * @param {object} request a RetrieveAndGenerateRequest
   */
  retrieveAndGenerateStream(request, callOptions) {
    return this._serverStream(this.ragStub, 'RetrieveAndGenerateStream', { request }, callOptions);
  }

  /**
   * Run the server's agent loop: yields RunAgentResponse objects (`event` 'thought', 'tool_call',
   * 'tool_result', then 'answer' last). Breaking out of the loop cancels the run.
   * @param {object} request a RunAgentRequest: {messages, tools?, tool_choice?, max_steps?, timeout_seconds?,
   *   tool_timeout_seconds?, parallel_tool_calls?, sampling?}
   */
  runAgent(request, callOptions) {
    return this._serverStream(this.agentStub, 'RunAgent', request, callOptions);
  }

  /** The tools an agent run may use: {tools: [{name, description, parameters}]}, parameters as plain JSON Schema. */
  async listTools(callOptions) {
    const { tools } = await this._unary('ListTools', {}, callOptions, this.agentStub);
    return { tools: tools.map((tool) => ({ ...tool, parameters: structToJson(tool.parameters) })) };
  }

  /**
   * Poll health until the server is SERVING, for at most timeoutMs; then reject with the last failure.
   * A server that is starting, loading its model or unreachable counts as "not yet";
   * other errors (say UNAUTHENTICATED) reject at once.
   */
  async waitUntilReady(timeoutMs = 120_000, intervalMs = 250) {
    const deadline = Date.now() + timeoutMs;
    let last;
    for (;;) {
      try {
        const probeMs = Math.max(50, Math.min(PROBE_TIMEOUT_MS, deadline - Date.now()));
        const health = await this.health({ timeoutMs: probeMs });
        if (health.status === 'SERVING_STATUS_SERVING') return health;
      } catch (err) {
        if (!(err instanceof ProtoserveError) || !NOT_READY_CODES.has(err.code)) throw err;
        last = err;
      }
      if (Date.now() + intervalMs >= deadline) {
        throw last || new ProtoserveError(grpc.status.DEADLINE_EXCEEDED, `server not serving after ${timeoutMs} ms`);
      }
      await new Promise((resolve) => setTimeout(resolve, intervalMs));
    }
  }

  /** Turn a google.rpc.Status from a Batch result into a ProtoserveError. */
  errorFromStatus(status) {
    return new ProtoserveError(status.code, status.message, decodeDetails(this.errorTypes, status));
  }

  /** Close the channel (shared by every service's stub). */
  close() {
    this.stub.close();
  }
}

module.exports = { ProtoserveClient, ProtoserveError, loadProtos, structToJson, grpc, DEFAULT_TARGET };
