// One streamed answer of /v1/chat/completions, built up chunk by chunk (no I/O).
//
// Deltas append, except a chunk marked `bmoe.reset`: the parser reclassified text
// already sent (a closing reasoning tag), and the delta holds the FULL content and
// reasoning so far, which replace what we hold. Tool calls open with their index,
// id and name and then append pieces of their arguments by index. An `error` chunk
// ends the answer with the server's own words.

export function newAnswer() {
  return {
    content: '',
    reasoning: '',
    toolCalls: [],
    error: null,
    finish: null,
    summary: null,
    usage: null,
    started: false,
    done: false,
  };
}

/** Apply one SSE `data:` payload (the raw string) to `answer`. Returns `answer`. */
export function applyData(answer, data) {
  if (data === '[DONE]') {
    answer.done = true;
    return answer;
  }
  let chunk;
  try {
    chunk = JSON.parse(data);
  } catch {
    return answer; // not JSON: nothing a client can read in it
  }
  return applyChunk(answer, chunk);
}

export function applyChunk(answer, chunk) {
  if (!chunk || typeof chunk !== 'object') return answer;
  answer.started = true;
  if (chunk.error !== undefined) {
    answer.error = errorOf(chunk.error);
    return answer;
  }
  if (chunk.usage) answer.usage = chunk.usage;
  const bmoe = chunk.bmoe || {};
  const choice = Array.isArray(chunk.choices) ? chunk.choices[0] : undefined;
  if (choice) {
    applyDelta(answer, choice.delta || {}, bmoe.reset === true);
    if (choice.finish_reason) answer.finish = choice.finish_reason;
  }
  if (bmoe.summary) answer.summary = bmoe.summary;
  return answer;
}

function applyDelta(answer, delta, reset) {
  if (reset) {
    if (typeof delta.content === 'string') answer.content = delta.content;
    if (typeof delta.reasoning_content === 'string') answer.reasoning = delta.reasoning_content;
  } else {
    if (typeof delta.reasoning_content === 'string') answer.reasoning += delta.reasoning_content;
    if (typeof delta.content === 'string') answer.content += delta.content;
  }
  if (Array.isArray(delta.tool_calls)) {
    for (const piece of delta.tool_calls) applyToolCall(answer, piece);
  }
}

function applyToolCall(answer, piece) {
  if (!piece || typeof piece !== 'object') return;
  const index = Number.isInteger(piece.index) ? piece.index : answer.toolCalls.length;
  let call = answer.toolCalls.find((c) => c.index === index);
  if (!call) {
    call = { index, id: '', type: 'function', name: '', arguments: '' };
    answer.toolCalls.push(call);
    answer.toolCalls.sort((a, b) => a.index - b.index);
  }
  if (typeof piece.id === 'string' && piece.id) call.id = piece.id;
  if (typeof piece.type === 'string') call.type = piece.type;
  const fn = piece.function || {};
  if (typeof fn.name === 'string' && fn.name) call.name = fn.name;
  if (typeof fn.arguments === 'string') call.arguments += fn.arguments;
}

/** `{message, code}` from an error in any of the shapes the server sends. */
export function errorOf(err, fallback = 'The request failed.') {
  if (typeof err === 'string') return { message: err, code: '' };
  if (err && typeof err === 'object') {
    const message = typeof err.message === 'string' ? err.message
      : typeof err.error === 'string' ? err.error : fallback;
    return { message, code: typeof err.code === 'string' ? err.code : '' };
  }
  return { message: fallback, code: '' };
}

/** The assistant message to resend in the history, or null when nothing came. */
export function historyMessage(answer) {
  const calls = answer.toolCalls.map((c) => ({
    id: c.id,
    type: 'function',
    function: { name: c.name, arguments: c.arguments },
  }));
  if (!answer.content && !answer.reasoning && !calls.length) return null;
  const msg = { role: 'assistant', content: answer.content || (calls.length ? null : '') };
  if (answer.reasoning) msg.reasoning_content = answer.reasoning;
  if (calls.length) msg.tool_calls = calls;
  return msg;
}

/** Tool-call arguments for a card: pretty JSON when they parse, else as written. */
export function prettyArguments(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}
