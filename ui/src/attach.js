// Images attached to the next message: picked with the Attach button or pasted into
// the message box, shown as thumbnails before sending and in the message after. What
// the server would refuse is refused here first, with the reason in the server's terms
// (and what still reaches the server and is refused there shows as the turn's error).
// An image travels inline as a data URL, as the spec asks; nothing is fetched.

import { h } from './dom.js';

export const IMAGE_TYPES = { 'image/png': 'PNG', 'image/jpeg': 'JPEG', 'image/gif': 'GIF', 'image/webp': 'WebP' };
export const MAX_IMAGES = 8; // per message
export const MAX_PIXELS = 64_000_000;
export const MAX_BYTES = 16 * 1024 * 1024; // a few screenshots within the 64 MiB body

/** Why a file cannot be attached (a sentence), or null. Pure. */
export function fileRefusal(file, { count, vision }) {
  const name = file.name || 'The pasted image';
  if (!vision) return 'The loaded model reads no images: load it with its image projector to send one.';
  if (!IMAGE_TYPES[file.type]) return `${name} is not a PNG, JPEG, GIF or WebP image.`;
  if (count >= MAX_IMAGES) return `A message may carry at most ${MAX_IMAGES} images.`;
  if (file.size > MAX_BYTES) return `${name} is ${(file.size / 1048576).toFixed(1)} MiB; an image may be at most ${MAX_BYTES / 1048576} MiB here.`;
  return null;
}

/** Why an image of this size cannot be sent, or null. Pure. */
export function pixelRefusal(name, width, height) {
  if (!width || !height) return `${name} could not be read as an image.`;
  if (width * height > MAX_PIXELS) return `${name} is ${width} x ${height} pixels (${((width * height) / 1e6).toFixed(1)} MP), more than the ${MAX_PIXELS / 1e6} MP an image may have.`;
  return null;
}

/** A user message's content: the text alone, or text then image parts. Pure. */
export function userContent(text, images) {
  if (!images.length) return text;
  const parts = text ? [{ type: 'text', text }] : [];
  for (const im of images) parts.push({ type: 'image_url', image_url: { url: im.url } });
  return parts;
}

/** The images of a user message's content (for its thumbnails). Pure. */
export function contentImages(content) {
  if (!Array.isArray(content)) return [];
  return content.filter((p) => p.type === 'image_url').map((p) => p.image_url.url);
}

/** The text of a user message's content. Pure. */
export function contentText(content) {
  if (!Array.isArray(content)) return content || '';
  return content.filter((p) => p.type === 'text').map((p) => p.text).join('\n');
}

function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(String(r.result));
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

function imageSize(url) {
  return new Promise((resolve) => {
    const img = new Image();
    img.onload = () => resolve([img.naturalWidth, img.naturalHeight]);
    img.onerror = () => resolve([0, 0]);
    img.src = url;
  });
}

export function thumbnail(url, name) {
  return h('img', { class: 'thumb', src: url, alt: name || 'attached image' });
}

export class Attachments {
  constructor({ button, input, tray, note, prompt, onChange, probeVision }) {
    this.images = [];
    this.vision = false;
    this.probeVision = probeVision || (async () => this.vision);
    this.button = button;
    this.input = input;
    this.tray = tray;
    this.note = note;
    this.onChange = onChange || (() => {});
    // Whether the loaded model reads images is asked of the server (GET /api/info) when
    // the page opens, when the message box gets the focus, and before any image is taken.
    button.addEventListener('click', async () => {
      if (this.vision || (await this.refreshVision())) input.click();
      else this.refuse(fileRefusal({}, { count: 0, vision: false }));
    });
    prompt.addEventListener('focus', () => this.refreshVision());
    input.addEventListener('change', () => {
      this.add([...input.files]);
      input.value = '';
    });
    prompt.addEventListener('paste', (e) => {
      const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter((f) => f.type.startsWith('image/'));
      if (!files.length) return;
      e.preventDefault();
      this.refreshVision().then(() => this.add(files));
    });
    this.setVision(false);
    this.refreshVision();
  }

  async refreshVision() {
    this.setVision(await this.probeVision());
    return this.vision;
  }

  setVision(vision) {
    this.vision = Boolean(vision);
    this.button.setAttribute('aria-disabled', this.vision ? 'false' : 'true');
    this.button.title = this.vision ? 'Attach an image (or paste one into the message)' : 'The loaded model reads no images';
  }

  refuse(reason) {
    this.note.textContent = reason || '';
    this.note.hidden = !reason;
  }

  async add(files) {
    this.refuse('');
    for (const file of files) {
      const why = fileRefusal(file, { count: this.images.length, vision: this.vision });
      if (why) {
        this.refuse(why);
        continue;
      }
      const name = file.name || 'pasted image';
      let url;
      try {
        url = await readDataURL(file);
      } catch (e) {
        this.refuse(`${name} could not be read.`);
        continue;
      }
      const [w, hgt] = await imageSize(url);
      const bad = pixelRefusal(name, w, hgt);
      if (bad) {
        this.refuse(bad);
        continue;
      }
      if (this.images.length >= MAX_IMAGES) {
        this.refuse(`A message may carry at most ${MAX_IMAGES} images.`);
        continue;
      }
      this.images.push({ url, name });
    }
    this.render();
  }

  take() {
    const out = this.images;
    this.images = [];
    this.render();
    return out;
  }

  render() {
    this.tray.replaceChildren(
      ...this.images.map((im, i) =>
        h(
          'span',
          { class: 'thumb-item' },
          thumbnail(im.url, im.name),
          h('button', { type: 'button', class: 'thumb-remove', title: `Remove ${im.name}`, 'aria-label': `Remove ${im.name}`, on: { click: () => this.remove(i) } }, '×'),
        ),
      ),
    );
    this.tray.hidden = !this.images.length;
    this.onChange();
  }

  remove(i) {
    this.images.splice(i, 1);
    this.render();
  }
}
