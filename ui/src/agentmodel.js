// The Agent screen's state, pure: the conversation list and the open conversation,
// kept up to date from the `conversation`, `item` and `delta` events. A page that
// reconnects reads GET /api/conversations/<id> and starts again from that.

/** Upsert (or drop, when `deleted`) one `conversation` event in a list, newest first. */
export function applyConversation(list, data) {
  const rest = list.filter((c) => c.id !== data.id);
  if (data.deleted) return rest;
  const old = list.find((c) => c.id === data.id) || {};
  return [{ ...old, ...data }, ...rest].sort((a, b) => b.updated - a.updated);
}

/** An `item` event on the open conversation: the item replaced whole, or appended. */
export function applyItem(conv, data) {
  if (!conv || data.conversation !== conv.id) return null;
  const i = conv.items.findIndex((it) => it.id === data.item.id);
  if (i >= 0) conv.items[i] = data.item;
  else conv.items.push(data.item);
  return data.item;
}

/** A `delta` event: what a streaming item adds to its text, reasoning or arguments. */
export function applyDelta(conv, data) {
  if (!conv || data.conversation !== conv.id) return null;
  const item = conv.items.find((it) => it.id === data.item);
  if (!item) return null;
  if (data.text) item.text = (item.text || '') + data.text;
  if (data.reasoning) item.reasoning = (item.reasoning || '') + data.reasoning;
  if (data.arguments) item.arguments = (item.arguments || '') + data.arguments;
  return item;
}

/** A tool call's arguments for a person: pretty JSON once whole, as written before. */
export function argumentsText(text) {
  if (!text) return '';
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

/** The workspace path a write or edit call names, when a preview makes sense. */
export function previewPath(item) {
  if (item.kind !== 'tool' || !['write_file', 'edit_file'].includes(item.name) || item.state !== 'done') return '';
  try {
    const path = JSON.parse(item.arguments).path;
    return typeof path === 'string' && /\.(html?|svg)$/i.test(path) ? path : '';
  } catch {
    return '';
  }
}

export const TOOL_STATE_TEXT = {
  composing: 'writing the call…',
  waiting: 'waiting for you',
  running: 'running…',
  done: 'done',
  denied: 'denied',
  failed: 'failed',
};

export const MODE_TEXT = {
  read: 'Read only',
  ask: 'Ask before changes',
  full: 'Full access',
};
