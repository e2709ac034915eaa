// Every request the page makes goes through here: the key, the JSON content type,
// and the one place a 401 turns into "ask for the key".
//
// The server refuses a POST/PUT/DELETE without `Content-Type: application/json`
// (body or no body), and, when started with a key, any /api or /v1 request
// without `Authorization: Bearer KEY`. The event stream is read with fetch for
// the same reason: EventSource cannot send a header.

import { errorOf } from './chatstream.js';

export const KEY_STORAGE = 'bmoe.apiKey';

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code || '';
  }
}

export class Api {
  /** @param {{askKey: (refused: boolean) => Promise<string>, storage?: Storage}} opts */
  constructor({ askKey, storage = window.localStorage }) {
    this.askKey = askKey;
    this.storage = storage;
    this.asking = null;
  }

  get key() {
    try {
      return this.storage.getItem(KEY_STORAGE) || '';
    } catch {
      return '';
    }
  }

  setKey(key) {
    this.storage.setItem(KEY_STORAGE, key);
  }

  forgetKey() {
    this.storage.removeItem(KEY_STORAGE);
  }

  headers(method) {
    const headers = {};
    if (method !== 'GET' && method !== 'HEAD') headers['Content-Type'] = 'application/json';
    const key = this.key;
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  /** One key prompt however many requests were refused at once. */
  needKey(refused) {
    if (!this.asking) {
      this.asking = this.askKey(refused).then((key) => {
        this.setKey(key);
        this.asking = null;
        return key;
      });
    }
    return this.asking;
  }

  /** fetch with the key and content type; a 401 asks for the key and retries. */
  async fetch(method, path, body, { signal } = {}) {
    for (;;) {
      const sentKey = this.key;
      const init = { method, headers: this.headers(method), signal, cache: 'no-store' };
      if (method !== 'GET' && method !== 'HEAD') init.body = JSON.stringify(body ?? {});
      const res = await fetch(path, init);
      if (res.status !== 401) return res;
      await res.body?.cancel();
      if (this.key && this.key !== sentKey) continue; // another request got a new key meanwhile
      await this.needKey(Boolean(sentKey));
    }
  }

  /** A JSON request; resolves to the body, throws ApiError with the server's words. */
  async json(method, path, body, opts) {
    const res = await this.fetch(method, path, body, opts);
    let data = null;
    try {
      data = await res.json();
    } catch {
      data = null;
    }
    if (!res.ok) {
      const err = errorOf(data, `${method} ${path} answered ${res.status}.`);
      throw new ApiError(res.status, err.message, err.code);
    }
    return data;
  }

  get(path, opts) {
    return this.json('GET', path, undefined, opts);
  }
}

/** The server's error body (`{error, code}`) from a failed response, as {message, code}. */
export async function responseError(res) {
  try {
    return errorOf(await res.json(), `The server answered ${res.status}.`);
  } catch {
    return { message: `The server answered ${res.status}.`, code: '' };
  }
}
