import { test } from 'node:test';
import assert from 'node:assert/strict';
import { applyConversation, applyItem, applyDelta, argumentsText, previewPath } from '../src/agentmodel.js';

test('conversation events upsert, sort and delete', () => {
  let list = [{ id: 'a', title: 'A', updated: 1 }];
  list = applyConversation(list, { id: 'b', title: 'B', state: 'idle', updated: 2 });
  assert.deepEqual(list.map((c) => c.id), ['b', 'a']);
  list = applyConversation(list, { id: 'a', title: 'A2', state: 'running', updated: 3 });
  assert.deepEqual(list.map((c) => c.title), ['A2', 'B']);
  list = applyConversation(list, { id: 'a', deleted: true });
  assert.deepEqual(list.map((c) => c.id), ['b']);
});

test('items and deltas build the open conversation', () => {
  const conv = { id: 'c', items: [] };
  assert.equal(applyItem(conv, { conversation: 'other', item: { id: 'x' } }), null);
  applyItem(conv, { conversation: 'c', item: { id: 'i1', kind: 'assistant', text: '', reasoning: '' } });
  applyDelta(conv, { conversation: 'c', item: 'i1', reasoning: 'hm' });
  applyDelta(conv, { conversation: 'c', item: 'i1', text: 'Hel' });
  applyDelta(conv, { conversation: 'c', item: 'i1', text: 'lo' });
  assert.equal(conv.items[0].text, 'Hello');
  assert.equal(conv.items[0].reasoning, 'hm');
  applyItem(conv, { conversation: 'c', item: { id: 't1', kind: 'tool', arguments: '' } });
  applyDelta(conv, { conversation: 'c', item: 't1', arguments: '{"pa' });
  applyDelta(conv, { conversation: 'c', item: 't1', arguments: 'th":"a"}' });
  assert.equal(argumentsText(conv.items[1].arguments), '{\n  "path": "a"\n}');
  applyItem(conv, { conversation: 'c', item: { id: 'i1', kind: 'assistant', text: 'Reset', reasoning: '' } });
  assert.equal(conv.items[0].text, 'Reset');
  assert.equal(argumentsText('{"pa'), '{"pa');
});

test('a preview is offered for a page the agent wrote', () => {
  const item = { kind: 'tool', name: 'write_file', state: 'done', arguments: '{"path":"site/index.html"}' };
  assert.equal(previewPath(item), 'site/index.html');
  assert.equal(previewPath({ ...item, state: 'running' }), '');
  assert.equal(previewPath({ ...item, arguments: '{"path":"a.py"}' }), '');
});
