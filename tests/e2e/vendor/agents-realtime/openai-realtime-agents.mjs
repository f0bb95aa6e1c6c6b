import { DEFAULT_OPENAI_REALTIME_MODEL as t, DEFAULT_OPENAI_REALTIME_SESSION_CONFIG as i, ModelBehaviorError as a, OpenAIRealtimeBase as l, OpenAIRealtimeSIP as o, OpenAIRealtimeWebRTC as E, OpenAIRealtimeWebSocket as n, OutputGuardrailTripwireTriggered as A, RealtimeAgent as I, RealtimeSession as R, UserError as s, backgroundResult as O, isBackgroundResult as g, setSensitiveDataLoggingEnabled as u, tool as m, utils as p } from "./index-D3yXDbeW.mjs";
export {
  t as DEFAULT_OPENAI_REALTIME_MODEL,
  i as DEFAULT_OPENAI_REALTIME_SESSION_CONFIG,
  a as ModelBehaviorError,
  l as OpenAIRealtimeBase,
  o as OpenAIRealtimeSIP,
  E as OpenAIRealtimeWebRTC,
  n as OpenAIRealtimeWebSocket,
  A as OutputGuardrailTripwireTriggered,
  I as RealtimeAgent,
  R as RealtimeSession,
  s as UserError,
  O as backgroundResult,
  g as isBackgroundResult,
  u as setSensitiveDataLoggingEnabled,
  m as tool,
  p as utils
};
