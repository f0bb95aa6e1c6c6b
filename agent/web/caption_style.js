// The caption overlay's look from its URL: size, position, colours, backing opacity, font.
// Every value is checked before it reaches CSS (a URL is anyone's input): numbers are clamped,
// keywords come from a list, colours are hex or a plain colour name that the browser resolves,
// font names are letters, digits, spaces and hyphens. A value that fails is ignored (the default
// stays) and listed in `ignored`, so a typo shows in window.captions rather than as a broken page.

const POSITIONS = { top: "flex-start", center: "center", bottom: "flex-end" };
const GENERIC_FONTS = new Set([
  "serif", "sans-serif", "monospace", "cursive", "fantasy", "system-ui",
  "ui-serif", "ui-sans-serif", "ui-monospace", "ui-rounded",
]);
const FONT_NAME = /^[A-Za-z0-9][A-Za-z0-9 -]{0,39}$/;
const HEX = /^#?([0-9a-f]{3}|[0-9a-f]{4}|[0-9a-f]{6}|[0-9a-f]{8})$/i;
const NAME = /^[a-z]{3,20}$/i;
const NOT_A_COLOUR = new Set(["inherit", "initial", "unset", "revert", "currentcolor"]);

export const DEFAULTS = Object.freeze({
  lines: 3,
  size: null, // px; null keeps the CSS default, clamp(24px, 5.5vh, 64px): readable at any source size
  position: "bottom",
  color: "#ffffff",
  bg: "#000000",
  // 0.6 black behind white text keeps 5.7:1 even over a white frame (WCAG AA asks 4.5:1).
  bg_opacity: 0.6,
  font: null,
});

function number(raw, min, max, integer) {
  if (raw === null || raw.trim() === "") return undefined;
  const n = Number(raw);
  if (!Number.isFinite(n)) return undefined;
  const v = Math.min(max, Math.max(min, n));
  return integer ? Math.round(v) : v;
}

// [r, g, b, a] (0-255, 0-1) of a checked colour, as the browser resolves it; undefined if not one.
export function parseColour(raw) {
  if (raw === null) return undefined;
  const value = raw.trim();
  let css;
  if (HEX.test(value)) css = value.startsWith("#") ? value : `#${value}`;
  else if (NAME.test(value) && !NOT_A_COLOUR.has(value.toLowerCase())) css = value.toLowerCase();
  if (!css || !CSS.supports("color", css)) return undefined;
  const probe = document.createElement("span");
  probe.style.color = css;
  document.body.append(probe);
  const resolved = getComputedStyle(probe).color; // "rgb(r, g, b)" or "rgba(r, g, b, a)"
  probe.remove();
  const parts = resolved.match(/[\d.]+/g);
  if (!parts || parts.length < 3) return undefined;
  const [r, g, b, a = 1] = parts.map(Number);
  return [r, g, b, a];
}

function luminance([r, g, b]) {
  const lin = (c) => ((c /= 255) <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4);
  return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
}

function over(top, below) {
  const a = top[3];
  return [0, 1, 2].map((i) => top[i] * a + below[i] * (1 - a)).concat(1);
}

// WCAG contrast of the text over its backing, at its worst over a black or a white frame.
export function worstContrast(text, backing) {
  return Math.min(
    ...[[0, 0, 0, 1], [255, 255, 255, 1]].map((frame) => {
      const bg = over(backing, frame);
      const fg = over(text, bg);
      const [hi, lo] = [luminance(fg), luminance(bg)].sort((x, y) => y - x);
      return (hi + 0.05) / (lo + 0.05);
    }),
  );
}

function fontFamily(raw) {
  if (raw === null) return undefined;
  const names = raw.split(",").map((n) => n.trim()).filter(Boolean);
  if (!names.length || names.length > 4 || !names.every((n) => FONT_NAME.test(n))) return undefined;
  const quoted = names.map((n) => (GENERIC_FONTS.has(n.toLowerCase()) ? n.toLowerCase() : `"${n}"`));
  return `${quoted.join(", ")}, system-ui, sans-serif`;
}

// Reads the style parameters and applies them as CSS custom properties on <html>; returns
// { style, ignored }: what was applied and the names of the parameters that were refused.
export function applyStyle(params, root = document.documentElement) {
  const ignored = [];
  const pick = (name, parsed) => {
    if (params.get(name) === null) return undefined;
    if (parsed === undefined) ignored.push(name);
    return parsed;
  };
  const style = { ...DEFAULTS };
  style.lines = pick("lines", number(params.get("lines"), 1, 6, true)) ?? DEFAULTS.lines;
  style.size = pick("size", number(params.get("size"), 12, 160, true)) ?? DEFAULTS.size;
  const position = params.get("position");
  style.position = pick("position", position !== null && Object.hasOwn(POSITIONS, position) ? position : undefined) ?? DEFAULTS.position;
  const text = pick("color", parseColour(params.get("color"))) ?? parseColour(DEFAULTS.color);
  const backing = pick("bg", parseColour(params.get("bg"))) ?? parseColour(DEFAULTS.bg);
  style.bg_opacity = pick("bg_opacity", number(params.get("bg_opacity"), 0, 1, false)) ?? DEFAULTS.bg_opacity;
  style.font = pick("font", fontFamily(params.get("font"))) ?? DEFAULTS.font;

  backing[3] *= style.bg_opacity;
  style.color = `rgba(${text.join(", ")})`;
  style.bg = `rgba(${backing.join(", ")})`;
  style.contrast = Math.round(worstContrast(text, backing) * 100) / 100;
  if (style.contrast < 4.5) console.warn(`captions: text/backing contrast ${style.contrast}:1 is below 4.5:1`);

  root.style.setProperty("--caption-color", style.color);
  root.style.setProperty("--caption-bg", style.bg);
  root.style.setProperty("--caption-justify", POSITIONS[style.position]);
  root.dataset.position = style.position; // the readouts move to the edge the lines leave free
  if (style.size !== null) root.style.setProperty("--caption-size", `${style.size}px`);
  if (style.font !== null) root.style.setProperty("--caption-font", style.font);
  if (ignored.length) console.warn(`captions: ignored ${ignored.join(", ")} (not a valid value)`);
  return { style, ignored };
}
