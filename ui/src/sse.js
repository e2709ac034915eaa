// Server-sent events, parsed from text as it arrives (no I/O here).
//
// The event stream and the chat stream are both read with fetch (so they carry
// the key), which leaves the SSE framing to us: `field: value` lines, a blank line
// ends an event, `:` starts a comment. Lines may end in \n, \r\n or \r, and a
// chunk may end anywhere, even between the \r and \n of one line ending.

export class SSEParser {
  /** @param {(ev: {event: string, data: string}) => void} onEvent
   *  @param {(text: string) => void} [onComment] */
  constructor(onEvent, onComment) {
    this.onEvent = onEvent;
    this.onComment = onComment || (() => {});
    this.buffer = '';
    this.event = '';
    this.data = [];
    this.skipLF = false;
  }

  /** Feed decoded text; complete events are dispatched as they finish. */
  feed(text) {
    let start = 0;
    let i = 0;
    if (this.skipLF && text.startsWith('\n')) {
      start = i = 1;
    }
    this.skipLF = false;
    for (; i < text.length; i++) {
      const c = text[i];
      if (c !== '\n' && c !== '\r') continue;
      this.line(this.buffer + text.slice(start, i));
      this.buffer = '';
      if (c === '\r') {
        if (i + 1 < text.length) {
          if (text[i + 1] === '\n') i++;
        } else {
          this.skipLF = true;
        }
      }
      start = i + 1;
    }
    this.buffer += text.slice(start);
  }

  line(line) {
    if (line === '') {
      this.dispatch();
      return;
    }
    if (line.startsWith(':')) {
      this.onComment(line.slice(1).replace(/^ /, ''));
      return;
    }
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'event') this.event = value;
    else if (field === 'data') this.data.push(value);
  }

  dispatch() {
    if (this.data.length) {
      this.onEvent({ event: this.event || 'message', data: this.data.join('\n') });
    }
    this.event = '';
    this.data = [];
  }
}

/** Read a fetch Response body as SSE until it ends (or the signal aborts). */
export async function readSSE(response, onEvent, onComment) {
  const parser = new SSEParser(onEvent, onComment);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      parser.feed(decoder.decode(value, { stream: true }));
    }
    parser.feed(decoder.decode());
  } finally {
    reader.releaseLock();
  }
}
