// Every request: the JSON content type on anything but GET, the key when kept,
// and a 401 that asks for the key once and retries.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { Api, KEY_STORAGE } from '../src/api.js';

function memoryStorage(init = {}) {
  const m = new Map(Object.entries(init));
  return { getItem: (k) => (m.has(k) ? m.get(k) : null), setItem: (k, v) => m.set(k, String(v)), removeItem: (k) => m.delete(k) };
}

function fakeFetch(answer) {
  const calls = [];
  globalThis.fetch = async (path, init) => {
    calls.push({ path, ...init });
    return answer(path, init, calls.length);
  };
  return calls;
}

const ok = (body) => new Response(JSON.stringify(body), { status: 200, headers: { 'Content-Type': 'application/json' } });

test('a POST says application/json even without a body; a GET does not', async () => {
  const calls = fakeFetch(() => ok({}));
  const api = new Api({ askKey: async () => 'k', storage: memoryStorage() });
  await api.json('POST', '/api/cancel');
  await api.get('/api/info');
  assert.equal(calls[0].headers['Content-Type'], 'application/json');
  assert.equal(calls[0].body, '{}');
  assert.equal(calls[1].headers['Content-Type'], undefined);
  assert.equal(calls[1].headers.Authorization, undefined);
});

test('a 401 asks for the key once, keeps it, and retries with it', async () => {
  const storage = memoryStorage();
  let asked = 0;
  const calls = fakeFetch((path, init) => (init.headers.Authorization === 'Bearer sekrit' ? ok({ path }) : new Response('{"error":"key","code":"unauthorized"}', { status: 401 })));
  const api = new Api({ askKey: async () => { asked += 1; return 'sekrit'; }, storage });
  const [a, b] = await Promise.all([api.get('/api/info'), api.get('/api/params')]);
  assert.equal(a.path, '/api/info');
  assert.equal(b.path, '/api/params');
  assert.equal(asked, 1);
  assert.equal(storage.getItem(KEY_STORAGE), 'sekrit');
  assert.ok(calls.some((c) => c.headers.Authorization === 'Bearer sekrit'));
});

test('a refused key asks again and says it was refused', async () => {
  const storage = memoryStorage({ [KEY_STORAGE]: 'old' });
  const refusedFlags = [];
  fakeFetch((path, init) => (init.headers.Authorization === 'Bearer new' ? ok({}) : new Response('{}', { status: 401 })));
  const api = new Api({ askKey: async (refused) => { refusedFlags.push(refused); return 'new'; }, storage });
  await api.get('/api/info');
  assert.deepEqual(refusedFlags, [true]);
});

test('an error answer throws the server words and code', async () => {
  fakeFetch(() => new Response('{"error":"No model is loaded.","code":"no_model"}', { status: 503 }));
  const api = new Api({ askKey: async () => 'k', storage: memoryStorage() });
  await assert.rejects(api.json('POST', '/api/session/load', {}), (e) => e.message === 'No model is loaded.' && e.code === 'no_model' && e.status === 503);
});
