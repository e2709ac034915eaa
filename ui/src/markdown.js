// Model output as sanitised Markdown: markdown-it renders, DOMPurify cleans.
//
// The rules are the spec's (Security model): no scripts, no form controls, no
// styles, nothing that fetches. An image stays only when its bytes are inline
// (data:image/png|gif|jpeg|webp) and is otherwise replaced by its alt text; media,
// srcset, poster and background go; links open in a new tab with no referrer.
// Beyond the spec, `class`, `id` and `name` are dropped too, so an answer cannot
// borrow the page's own classes to restyle it or clobber a named global.
//
// Raw HTML in the model's text is shown as text (markdown-it's `html: false`), and
// the table rule's `style="text-align"` is dropped before anything is parsed: the
// browser reports a CSP violation for every inline style it merely parses, even in
// DOMPurify's inert document, so style must never reach a parser at all. DOMPurify
// still cleans what markdown-it writes (links, images), and `sanitize` holds the
// same rules for HTML from anywhere.
//
// The result is a DocumentFragment (no re-parse of a string), to be put in place
// with `replaceChildren`.

import createDOMPurify from 'dompurify';
import MarkdownIt from 'markdown-it';

export const FORBID_TAGS = [
  // scripts and styles
  'script', 'noscript', 'style', 'link', 'meta', 'base', 'template', 'slot',
  // form controls
  'form', 'input', 'button', 'textarea', 'select', 'option', 'optgroup', 'datalist',
  'fieldset', 'legend', 'label', 'output', 'dialog',
  // media, frames, embedded documents
  'video', 'audio', 'picture', 'source', 'track', 'iframe', 'frame', 'frameset',
  'object', 'embed', 'applet', 'portal', 'canvas', 'map', 'area', 'image',
  // other markup languages
  'svg', 'math',
];

export const FORBID_ATTR = [
  'style', 'srcset', 'sizes', 'poster', 'background', 'lowsrc', 'dynsrc',
  'action', 'formaction', 'form', 'ping', 'download', 'usemap',
  'class', 'id', 'name', 'target', 'rel', 'referrerpolicy',
];

/** The only image sources kept: bytes inline, of four raster types. */
export const INLINE_IMAGE = /^data:image\/(?:png|gif|jpeg|webp)[;,]/i;

/** The only link targets kept (anything else loses its href). */
export const LINK_URL = /^(?:https?:|mailto:)/i;

export const PURIFY_CONFIG = {
  USE_PROFILES: { html: true },
  FORBID_TAGS,
  FORBID_ATTR,
  ALLOWED_URI_REGEXP: LINK_URL,
  ALLOW_DATA_ATTR: false,
  ALLOW_ARIA_ATTR: false,
  SAFE_FOR_TEMPLATES: false,
  KEEP_CONTENT: true,
  RETURN_DOM_FRAGMENT: true,
};

/** A renderer bound to a window (the page's, or jsdom's in the tests). */
export function createRenderer(win) {
  const purify = createDOMPurify(win);
  const md = new MarkdownIt({ html: false, linkify: true, breaks: true });
  md.core.ruler.push('drop_styles', dropStyles);

  function finish(fragment) {
    const doc = fragment.ownerDocument;
    for (const img of Array.from(fragment.querySelectorAll('img'))) {
      const src = img.getAttribute('src') || '';
      if (!INLINE_IMAGE.test(src)) {
        img.replaceWith(doc.createTextNode(img.getAttribute('alt') || ''));
      }
    }
    for (const a of Array.from(fragment.querySelectorAll('a'))) {
      const href = a.getAttribute('href');
      if (href !== null && LINK_URL.test(href.trim())) {
        a.setAttribute('target', '_blank');
        a.setAttribute('rel', 'noopener noreferrer');
        a.setAttribute('referrerpolicy', 'no-referrer');
      } else {
        a.removeAttribute('href');
      }
    }
    return fragment;
  }

  /** Sanitise HTML into a fragment. */
  function sanitize(html) {
    return finish(purify.sanitize(String(html), PURIFY_CONFIG));
  }

  /** Markdown (which may hold HTML) into a sanitised fragment. */
  function render(markdown) {
    return sanitize(md.render(String(markdown)));
  }

  /** The same, serialised: for tests and debugging. */
  function renderToHTML(markdown) {
    const div = win.document.createElement('div');
    div.append(render(markdown));
    return div.innerHTML;
  }

  function sanitizeToHTML(html) {
    const div = win.document.createElement('div');
    div.append(sanitize(html));
    return div.innerHTML;
  }

  return { render, sanitize, renderToHTML, sanitizeToHTML };
}

/** markdown-it core rule: no token keeps a `style` attribute (table alignment). */
function dropStyles(state) {
  const walk = (tokens) => {
    for (const t of tokens) {
      if (t.attrs) t.attrs = t.attrs.filter(([name]) => name.toLowerCase() !== 'style');
      if (t.children) walk(t.children);
    }
  };
  walk(state.tokens);
}
