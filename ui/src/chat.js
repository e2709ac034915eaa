// The chat: a conversation the page keeps and resends whole each turn, streamed
// from POST /v1/chat/completions.
//
// A turn that failed (an error chunk, a refusal) stays on screen in the server's
// words but leaves the history, so the next request is one the template accepts.
// Stop is POST /api/cancel once our turn runs; while the request still waits its
// place in line, stopping drops the connection instead, which gives the place up
// and cancels nobody else's turn.

import { h, byId, fill } from './dom.js';
import { readSSE } from './sse.js';
import { responseError } from './api.js';
import { newAnswer, applyData, historyMessage, prettyArguments } from './chatstream.js';
import { fmt, fmtSeconds } from './metrics.js';
import { Attachments, contentImages, contentText, thumbnail, userContent } from './attach.js';

const FINISH_TEXT = {
  stop: '',
  length: 'Stopped at the token limit.',
  cancelled: 'Stopped.',
  tool_calls: 'The model called a tool.',
};

const MIN_RENDER_MS = 60; // markdown is rendered again at most this often per answer

export class Chat {
  constructor({ api, renderer, onBusy }) {
    this.api = api;
    this.renderer = renderer;
    this.onBusy = onBusy || (() => {});
    this.turns = [];
    this.current = null;
    this.transcript = byId('transcript');
    this.prompt = byId('prompt');
    this.sendButton = byId('send');
    this.stopButton = byId('stop');
    this.think = byId('think');
    this.sendButton.addEventListener('click', () => this.submit());
    this.stopButton.addEventListener('click', () => this.stop());
    byId('new-chat').addEventListener('click', () => this.clear());
    this.prompt.addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.submit();
      }
    });
    this.prompt.addEventListener('input', () => this.updateButtons());
    this.attachments = new Attachments({
      button: byId('attach'),
      input: byId('attach-file'),
      tray: byId('attach-tray'),
      note: byId('attach-note'),
      prompt: this.prompt,
      onChange: () => this.updateButtons(),
      probeVision: () =>
        this.api
          .get('/api/info')
          .then((i) => Boolean(i && i.state === 'ready' && i.model && i.model.vision))
          .catch(() => false),
    });
    this.updateButtons();
  }

  /** Label and default of the thinking toggle, from the parameter table and config. */
  setThinkParam(param, value) {
    if (!param) return;
    byId('think-label').textContent = param.label;
    byId('think-toggle').hidden = false;
    byId('think-toggle').title = param.help || '';
    if (typeof value === 'boolean') this.think.checked = value;
  }

  history() {
    const messages = [];
    for (const t of this.turns) {
      if (!t.inHistory) continue;
      messages.push(t.user);
      if (t.assistant) messages.push(t.assistant);
    }
    return messages;
  }

  clear() {
    if (this.current) return;
    this.turns = [];
    this.transcript.replaceChildren();
    this.attachments.take();
    this.attachments.refuse('');
    this.prompt.focus();
  }

  updateButtons() {
    const busy = Boolean(this.current);
    const images = this.attachments ? this.attachments.images.length : 0;
    this.sendButton.disabled = busy || (!this.prompt.value.trim() && !images);
    this.stopButton.hidden = !busy;
    this.sendButton.hidden = busy;
    byId('new-chat').disabled = busy;
  }

  submit() {
    const text = this.prompt.value.trim();
    if ((!text && !this.attachments.images.length) || this.current) return;
    this.prompt.value = '';
    this.send(text, this.attachments.take());
  }

  async send(text, images = []) {
    const turn = {
      user: { role: 'user', content: userContent(text, images) },
      assistant: null,
      answer: newAnswer(),
      inHistory: false,
      waiting: false,
      aborted: false,
      controller: new AbortController(),
      lastRender: 0,
      renderTimer: 0,
    };
    const messages = [...this.history(), turn.user];
    this.turns.push(turn);
    this.current = turn;
    this.mountTurn(turn);
    this.updateButtons();
    this.onBusy(true);
    const body = {
      messages,
      stream: true,
      stream_options: { include_usage: true },
      think: this.think.checked,
    };
    try {
      const res = await this.api.fetch('POST', '/v1/chat/completions', body, { signal: turn.controller.signal });
      if (!res.ok) {
        turn.answer.error = await responseError(res);
      } else {
        await readSSE(
          res,
          (ev) => {
            turn.waiting = false;
            applyData(turn.answer, ev.data);
            this.scheduleRender(turn);
          },
          (comment) => {
            if (comment.startsWith('waiting')) {
              turn.waiting = true;
              this.scheduleRender(turn);
            }
          },
        );
        if (!turn.answer.done && !turn.answer.error && !turn.answer.finish) {
          turn.answer.error = { message: 'The answer stopped before it was complete: the connection closed.', code: '' };
        }
      }
    } catch (e) {
      if (turn.aborted) turn.answer.finish = turn.answer.finish || 'cancelled';
      else turn.answer.error = { message: `The connection failed: ${e.message || e}`, code: '' };
    } finally {
      this.finishTurn(turn);
    }
  }

  finishTurn(turn) {
    const msg = historyMessage(turn.answer);
    if (!turn.answer.error && msg) {
      turn.assistant = msg;
      turn.inHistory = true;
    }
    this.current = null;
    clearTimeout(turn.renderTimer);
    this.render(turn);
    this.updateButtons();
    this.onBusy(false);
  }

  async stop() {
    const turn = this.current;
    if (!turn) return;
    this.stopButton.disabled = true;
    try {
      if (turn.answer.started) {
        await this.api.json('POST', '/api/cancel', {});
      } else {
        turn.aborted = true;
        turn.controller.abort();
      }
    } catch (e) {
      turn.aborted = true;
      turn.controller.abort();
    } finally {
      this.stopButton.disabled = false;
    }
  }

  // -- rendering ------------------------------------------------------------------

  mountTurn(turn) {
    const pics = contentImages(turn.user.content);
    const user = h(
      'div',
      { class: 'msg msg-user' },
      h('div', { class: 'msg-role', text: 'You' }),
      pics.length ? h('div', { class: 'msg-images' }, ...pics.map((u, i) => thumbnail(u, `image ${i + 1}`))) : null,
      h('div', { class: 'msg-text', text: contentText(turn.user.content) }),
    );
    turn.els = {
      status: h('div', { class: 'msg-status' }),
      reasoningCount: h('span', { class: 'reasoning-count' }),
      reasoningText: h('div', { class: 'reasoning-text' }),
      content: h('div', { class: 'md' }),
      tools: h('div', { class: 'tool-calls' }),
      error: h('div', { class: 'msg-error', role: 'alert', hidden: true }),
      footer: h('div', { class: 'msg-footer' }),
    };
    turn.els.reasoning = h(
      'details',
      { class: 'reasoning', hidden: true },
      h('summary', {}, 'Reasoning ', turn.els.reasoningCount),
      turn.els.reasoningText,
    );
    const e = turn.els;
    turn.els.box = h(
      'div',
      { class: 'msg msg-assistant', 'aria-busy': 'true' },
      h('div', { class: 'msg-role', text: 'Model' }),
      e.status,
      e.reasoning,
      e.content,
      e.tools,
      e.error,
      e.footer,
    );
    this.transcript.append(user, turn.els.box);
    this.render(turn);
    this.scrollToEnd(true);
  }

  scheduleRender(turn) {
    if (turn.renderTimer) return;
    const wait = Math.max(0, MIN_RENDER_MS - (performance.now() - turn.lastRender));
    turn.renderTimer = setTimeout(() => {
      turn.renderTimer = 0;
      requestAnimationFrame(() => this.render(turn));
    }, wait);
  }

  render(turn) {
    turn.lastRender = performance.now();
    const a = turn.answer;
    const e = turn.els;
    const live = this.current === turn;
    const stick = this.nearEnd();

    e.status.textContent = live ? (turn.waiting ? 'Waiting for a turn…' : !a.content && !a.reasoning && !a.toolCalls.length ? (a.started ? 'Reading the prompt…' : 'Sending…') : '') : '';
    e.status.hidden = !e.status.textContent;

    e.reasoning.hidden = !a.reasoning;
    if (a.reasoning) {
      e.reasoningText.textContent = a.reasoning;
      const words = a.reasoning.trim().split(/\s+/).length;
      e.reasoningCount.textContent = live && !a.content ? `(thinking… ${words} words)` : `(${words} words)`;
    }

    if (a.content !== turn.renderedContent) {
      e.content.replaceChildren(this.renderer.render(a.content));
      turn.renderedContent = a.content;
    }
    e.content.classList.toggle('streaming', live);

    if (a.toolCalls.length !== e.tools.childElementCount || live || !turn.toolsDone) {
      e.tools.replaceChildren(...a.toolCalls.map((c) => toolCard(c)));
      turn.toolsDone = !live;
    }

    e.error.hidden = !a.error;
    if (a.error) {
      fill(e.error, h('span', { class: 'msg-error-text', text: a.error.message }), a.error.code ? h('code', { class: 'msg-error-code', text: a.error.code }) : null);
    }

    e.footer.replaceChildren(...footerParts(a, live));
    e.box.setAttribute('aria-busy', live ? 'true' : 'false');
    e.box.dataset.finish = a.error ? 'error' : a.finish || (live ? 'streaming' : '');
    if (stick) this.scrollToEnd();
  }

  nearEnd() {
    const t = this.transcript;
    return t.scrollHeight - t.scrollTop - t.clientHeight < 80;
  }

  scrollToEnd(force) {
    if (force || this.nearEnd()) this.transcript.scrollTop = this.transcript.scrollHeight;
  }
}

function toolCard(call) {
  return h(
    'div',
    { class: 'tool-card' },
    h('div', { class: 'tool-head' }, h('span', { class: 'tool-kind', text: 'Tool call' }), h('span', { class: 'tool-name', text: call.name || '…' }), call.id ? h('code', { class: 'tool-id', text: call.id }) : null),
    h('pre', { class: 'tool-args', text: prettyArguments(call.arguments) }),
  );
}

function footerParts(a, live) {
  const parts = [];
  if (!live && a.finish && FINISH_TEXT[a.finish]) parts.push(h('span', { class: `finish finish-${a.finish}`, text: FINISH_TEXT[a.finish] }));
  const s = a.summary;
  if (s) {
    parts.push(h('span', { class: 'stat', text: `${s.tokens} tokens` }));
    parts.push(h('span', { class: 'stat', text: `${fmt(s.tok_s)} tok/s` }));
    if (Number.isFinite(s.ttft_s)) parts.push(h('span', { class: 'stat', text: `first token ${fmtSeconds(s.ttft_s)}` }));
  }
  const cached = a.usage && a.usage.prompt_tokens_details ? a.usage.prompt_tokens_details.cached_tokens : null;
  if (a.usage) parts.push(h('span', { class: 'stat', text: `prompt ${a.usage.prompt_tokens} tokens${cached ? `, ${cached} reused` : ''}` }));
  return parts;
}
