// The chat stream's reducer: appends, bmoe.reset, tool calls, errors, summary.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { newAnswer, applyData, historyMessage, prettyArguments, errorOf } from '../src/chatstream.js';

const chunk = (delta, extra = {}, finish = null) => JSON.stringify({
  id: 'c', object: 'chat.completion.chunk', choices: [{ index: 0, delta, finish_reason: finish }], ...extra,
});

function run(...datas) {
  const a = newAnswer();
  for (const d of datas) applyData(a, d);
  return a;
}

test('content and reasoning deltas append', () => {
  const a = run(
    chunk({ role: 'assistant', content: '' }),
    chunk({ reasoning_content: 'Let me ' }),
    chunk({ reasoning_content: 'think.' }),
    chunk({ content: 'Hello' }),
    chunk({ content: ', world' }),
  );
  assert.equal(a.reasoning, 'Let me think.');
  assert.equal(a.content, 'Hello, world');
  assert.ok(a.started);
});

test('a reset chunk replaces both texts instead of appending', () => {
  const a = run(
    chunk({ content: '<think>Let me' }),
    chunk({ content: ' think</think>' }),
    chunk({ content: 'Answer', reasoning_content: 'Let me think' }, { bmoe: { reset: true } }),
    chunk({ content: ' goes on' }),
  );
  assert.equal(a.reasoning, 'Let me think');
  assert.equal(a.content, 'Answer goes on');
});

test('a reset to empty content empties it', () => {
  const a = run(chunk({ content: 'partial <tool' }), chunk({ content: '', reasoning_content: '' }, { bmoe: { reset: true } }));
  assert.equal(a.content, '');
  assert.equal(a.reasoning, '');
});

test('tool calls open by index and append their arguments', () => {
  const a = run(
    chunk({ tool_calls: [{ index: 0, id: 'call_a', type: 'function', function: { name: 'get_weather', arguments: '' } }] }),
    chunk({ tool_calls: [{ index: 0, function: { arguments: '{"city": ' } }] }),
    chunk({ tool_calls: [{ index: 1, id: 'call_b', type: 'function', function: { name: 'get_time', arguments: '' } }] }),
    chunk({ tool_calls: [{ index: 0, function: { arguments: '"Paris"}' } }] }),
    chunk({ tool_calls: [{ index: 1, function: { arguments: '{}' } }] }),
    chunk({}, {}, 'tool_calls'),
  );
  assert.deepEqual(a.toolCalls.map((c) => [c.index, c.id, c.name, c.arguments]), [
    [0, 'call_a', 'get_weather', '{"city": "Paris"}'],
    [1, 'call_b', 'get_time', '{}'],
  ]);
  assert.equal(a.finish, 'tool_calls');
  const msg = historyMessage(a);
  assert.equal(msg.content, null);
  assert.deepEqual(msg.tool_calls[0], { id: 'call_a', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } });
});

test('an error chunk keeps the server words and code', () => {
  const a = run(chunk({ content: 'Some text' }), JSON.stringify({ error: { message: 'The context is full: raise Context.', code: 'context_full' } }), '[DONE]');
  assert.deepEqual(a.error, { message: 'The context is full: raise Context.', code: 'context_full' });
  assert.equal(a.content, 'Some text');
  assert.ok(a.done);
});

test('the last chunk carries finish_reason and the summary; usage follows', () => {
  const summary = { tokens: 3, tok_s: 12.5, ttft_s: 0.2 };
  const a = run(
    chunk({ content: 'abc' }),
    chunk({}, { bmoe: { summary } }, 'cancelled'),
    JSON.stringify({ choices: [], usage: { prompt_tokens: 9, completion_tokens: 3, prompt_tokens_details: { cached_tokens: 4 } } }),
    '[DONE]',
  );
  assert.equal(a.finish, 'cancelled');
  assert.deepEqual(a.summary, summary);
  assert.equal(a.usage.prompt_tokens_details.cached_tokens, 4);
  assert.ok(a.done);
});

test('data that is not JSON is ignored', () => {
  const a = run('not json', chunk({ content: 'x' }));
  assert.equal(a.content, 'x');
});

test('the history message carries reasoning, and nothing when nothing came', () => {
  assert.equal(historyMessage(newAnswer()), null);
  const a = run(chunk({ reasoning_content: 'r' }), chunk({ content: 'c' }));
  assert.deepEqual(historyMessage(a), { role: 'assistant', content: 'c', reasoning_content: 'r' });
});

test('errorOf reads the shapes the server sends', () => {
  assert.deepEqual(errorOf({ error: 'No model is loaded.', code: 'no_model' }), { message: 'No model is loaded.', code: 'no_model' });
  assert.deepEqual(errorOf({ message: 'm', code: 'c' }), { message: 'm', code: 'c' });
  assert.deepEqual(errorOf('text'), { message: 'text', code: '' });
  assert.equal(errorOf(null, 'fallback').message, 'fallback');
});

test('tool arguments are pretty when they parse and as written otherwise', () => {
  assert.equal(prettyArguments('{"a":1}'), '{\n  "a": 1\n}');
  assert.equal(prettyArguments('{"a":'), '{"a":');
});
