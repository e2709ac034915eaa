// Attaching images: what is refused here, with which reason, and the message it makes.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { contentImages, contentText, fileRefusal, MAX_BYTES, MAX_IMAGES, pixelRefusal, userContent } from '../src/attach.js';

const png = { name: 'shot.png', type: 'image/png', size: 1000 };

test('an image is refused before it is read: no vision, a type, a count, a size', () => {
  assert.equal(fileRefusal(png, { count: 0, vision: true }), null);
  assert.match(fileRefusal(png, { count: 0, vision: false }), /reads no images/);
  assert.match(fileRefusal({ ...png, name: 'a.svg', type: 'image/svg+xml' }, { count: 0, vision: true }), /a\.svg is not a PNG, JPEG, GIF or WebP/);
  assert.match(fileRefusal(png, { count: MAX_IMAGES, vision: true }), /at most 8 images/);
  assert.match(fileRefusal({ ...png, size: MAX_BYTES + 1 }, { count: 0, vision: true }), /MiB/);
  for (const type of ['image/jpeg', 'image/gif', 'image/webp']) assert.equal(fileRefusal({ ...png, type }, { count: 1, vision: true }), null);
});

test('more than 64 megapixels is refused with its size', () => {
  assert.equal(pixelRefusal('a', 8000, 8000), null);
  assert.match(pixelRefusal('a', 8100, 8100), /8100 x 8100 pixels \(65\.6 MP\)/);
  assert.match(pixelRefusal('a', 0, 0), /could not be read/);
});

test('a message with images is text then image_url parts; without, a string', () => {
  assert.equal(userContent('hi', []), 'hi');
  const c = userContent('look', [{ url: 'data:image/png;base64,AA' }, { url: 'data:image/gif;base64,BB' }]);
  assert.deepEqual(c, [
    { type: 'text', text: 'look' },
    { type: 'image_url', image_url: { url: 'data:image/png;base64,AA' } },
    { type: 'image_url', image_url: { url: 'data:image/gif;base64,BB' } },
  ]);
  assert.deepEqual(contentImages(c), ['data:image/png;base64,AA', 'data:image/gif;base64,BB']);
  assert.equal(contentText(c), 'look');
  assert.deepEqual(userContent('', [{ url: 'data:,' }]), [{ type: 'image_url', image_url: { url: 'data:,' } }]);
});
