"""The JSON-schema suite for structured outputs (OpenAI `response_format: json_schema`).

Data, no tests: tests/test_structured_schemas.py random-walks every schema through
llguidance (proving the library compiles and enforces it end to end), the engine and server tests
decode the real default model (SmolLM2-135M-Instruct) under each and check the text with
`validate` (tests/schema_validation.py).

Every case is *bounded* unless marked `bounded=False`: each free string has a `maxLength` (<= 40),
each array a `maxItems` (<= 5), and each object `additionalProperties: false`, so that a 135M
model finishes inside ~200 tokens. Two cases deliberately leave strings (and, in one, an array)
unbounded, for tests that want to see max_tokens end a constrained generation.

Coverage: flat and nested objects (four levels deep), arrays with minItems/maxItems (of strings,
objects, arrays, a top-level array, a prefixItems tuple), enums (strings, integers, mixed with
null), `const`, `anyOf`, `oneOf` (with disjoint branches: llguidance refuses overlapping ones),
integer and number bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf),
string formats (date, time, date-time, email, uuid, ipv4, ipv6), `pattern`, minLength/maxLength,
required vs optional properties, `additionalProperties: false`, `$defs` with `$ref`, booleans,
nulls and nullable types, type unions, annotations (title, description), and OpenAI-style tool
call arguments (get_weather).

Keywords llguidance 1.9.1 does not implement, and so left out of the suite (it warns "Unimplemented
keys" or refuses): `propertyNames`, `contains`, `dependentRequired`, `uniqueItems`, overlapping
`oneOf` branches (it asks for the `coerce_one_of` option), and `minProperties`/`maxProperties`
unless every listed property is required. Formats `hostname`, `duration` and `uri` compile, but
jsonschema cannot check them here (its checkers need fqdn, isoduration, rfc3987), so they are left
out too; see tests/schema_validation.py's `FORMAT_CHECKER` for date-time and time.
"""

from schema_validation import SchemaCase


def _str(max_length: int, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


SCHEMAS: list[SchemaCase] = [
    SchemaCase(
        "book",
        {
            "type": "object",
            "properties": {
                "title": _str(40),
                "author": _str(40),
                "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
            },
            "required": ["title", "author", "year"],
            "additionalProperties": False,
        },
        "Give a JSON object describing a book: title, author, year.",
        example={"title": "Dune", "author": "Frank Herbert", "year": 1965},
    ),
    SchemaCase(
        "person_with_address",  # a nested object
        {
            "type": "object",
            "properties": {
                "name": _str(30),
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": _str(40),
                        "city": _str(30),
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "age", "address"],
            "additionalProperties": False,
        },
        "Give a JSON object describing a person: name, age, and an address with street, city and a 5-digit zip.",
        example={
            "name": "Ana Silva",
            "age": 34,
            "address": {"street": "12 Rua Augusta", "city": "Lisbon", "zip": "11000"},
        },
    ),
    SchemaCase(
        "shopping_list",  # an array of strings with minItems/maxItems
        {
            "type": "object",
            "properties": {
                "store": _str(30),
                "items": {"type": "array", "items": _str(20), "minItems": 2, "maxItems": 5},
            },
            "required": ["store", "items"],
            "additionalProperties": False,
        },
        "Give a JSON shopping list: the store and two to five items to buy.",
        example={"store": "Corner Market", "items": ["milk", "eggs", "bread"]},
    ),
    SchemaCase(
        "weekday_enum",
        {
            "type": "object",
            "properties": {
                "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]},
                "mood": {"type": "string", "enum": ["happy", "sad", "tired", "excited"]},
            },
            "required": ["day", "mood"],
            "additionalProperties": False,
        },
        "Give a JSON object with your favourite day of the week and your mood on that day.",
        example={"day": "Saturday", "mood": "happy"},
    ),
    SchemaCase(
        "event_const",  # `const` fixes the values
        {
            "type": "object",
            "properties": {
                "version": {"const": 2},
                "kind": {"const": "login"},
                "user": _str(24),
                "success": {"type": "boolean"},
            },
            "required": ["version", "kind", "user", "success"],
            "additionalProperties": False,
        },
        "Give a JSON log event (version 2, kind login) for a user named alice who logged in successfully.",
        example={"version": 2, "kind": "login", "user": "alice", "success": True},
    ),
    SchemaCase(
        "contact_anyof",
        {
            "type": "object",
            "properties": {
                "name": _str(30),
                "contact": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
                            "required": ["email"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}},
                            "required": ["phone"],
                            "additionalProperties": False,
                        },
                    ]
                },
            },
            "required": ["name", "contact"],
            "additionalProperties": False,
        },
        "Give a JSON contact card: a name and either an email address or a phone number.",
        example={"name": "Bob Stone", "contact": {"email": "bob@example.com"}},
    ),
    SchemaCase(
        "shape_oneof",  # branches told apart by a `const` discriminator, so exactly one matches
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {
                        "shape": {"const": "circle"},
                        "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                    },
                    "required": ["shape", "radius"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "shape": {"const": "rectangle"},
                        "width": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                        "height": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                    },
                    "required": ["shape", "width", "height"],
                    "additionalProperties": False,
                },
            ]
        },
        "Describe a shape as JSON: either a circle with a radius or a rectangle with a width and height.",
        example={"shape": "rectangle", "width": 4.5, "height": 2},
    ),
    SchemaCase(
        "thermostat_numbers",  # integer and number bounds
        {
            "type": "object",
            "properties": {
                "target_celsius": {"type": "number", "minimum": 5, "maximum": 30},
                "humidity_percent": {"type": "integer", "minimum": 0, "maximum": 100},
                "fan_speed": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 10},
                "power_watts": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 5000},
            },
            "required": ["target_celsius", "humidity_percent", "fan_speed", "power_watts"],
            "additionalProperties": False,
        },
        "Give a JSON thermostat setting: target temperature in Celsius, humidity percent, fan speed, power in watts.",
        example={"target_celsius": 21.5, "humidity_percent": 45, "fan_speed": 30, "power_watts": 1200},
    ),
    SchemaCase(
        "meeting_datetime",  # date, time, date-time formats
        {
            "type": "object",
            "properties": {
                "title": _str(40),
                "date": {"type": "string", "format": "date"},
                # time and date-time allow fractional seconds of any length: a small model can
                # write digits forever there, so the lengths are bounded (llguidance intersects them)
                "start_time": {"type": "string", "format": "time", "maxLength": 20},
                "created_at": {"type": "string", "format": "date-time", "maxLength": 32},
            },
            "required": ["title", "date", "start_time", "created_at"],
            "additionalProperties": False,
        },
        "Give a JSON object for a team meeting: title, date, start time, and when the invite was created.",
        example={
            "title": "Weekly sync",
            "date": "2025-03-14",
            "start_time": "10:30:00Z",
            "created_at": "2025-03-10T08:15:00+01:00",
        },
    ),
    SchemaCase(
        "user_account",  # uuid and email formats, a pattern with lengths
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "email": {"type": "string", "format": "email", "maxLength": 40},
                "username": {"type": "string", "minLength": 3, "maxLength": 16, "pattern": "^[a-z0-9_]+$"},
            },
            "required": ["id", "email", "username"],
            "additionalProperties": False,
        },
        "Give a JSON user account with a UUID id, an email address and a lowercase username.",
        example={"id": "3f2b8c1e-9d4a-4e7b-a1c2-5d6e7f8a9b0c", "email": "jo@example.org", "username": "jo_smith"},
    ),
    SchemaCase(
        "server_addresses",  # ipv4 and ipv6 formats
        {
            "type": "object",
            "properties": {
                "name": _str(24),
                "ipv4": {"type": "string", "format": "ipv4"},
                "ipv6": {"type": "string", "format": "ipv6"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            },
            "required": ["name", "ipv4", "ipv6", "port"],
            "additionalProperties": False,
        },
        "Give a JSON object for a web server: its name, IPv4 address, IPv6 address and port.",
        example={"name": "web-1", "ipv4": "192.168.1.10", "ipv6": "2001:db8::1", "port": 8080},
    ),
    SchemaCase(
        "product_pattern",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "color_hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
                "name": _str(30),
            },
            "required": ["sku", "color_hex", "name"],
            "additionalProperties": False,
        },
        "Give a JSON product: an SKU like ABC-1234, its color as a hex code like #ff0000, and its name.",
        example={"sku": "ABC-1234", "color_hex": "#ff0000", "name": "Red mug"},
    ),
    SchemaCase(
        "string_lengths",  # minLength/maxLength
        {
            "type": "object",
            "properties": {
                "nickname": {"type": "string", "minLength": 2, "maxLength": 12},
                "pin": {"type": "string", "minLength": 4, "maxLength": 6, "pattern": "^[0-9]+$"},
                "motto": {"type": "string", "minLength": 10, "maxLength": 40},
            },
            "required": ["nickname", "pin", "motto"],
            "additionalProperties": False,
        },
        "Give a JSON profile with a short nickname, a 4 to 6 digit PIN and a motto.",
        example={"nickname": "Kiki", "pin": "4821", "motto": "Carpe diem, always."},
    ),
    SchemaCase(
        "optional_profile",  # only "name" is required
        {
            "type": "object",
            "properties": {
                "name": _str(30),
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": _str(30),
                "nickname": _str(20),
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        "Give a JSON profile of a person. The name is required; age, city and nickname are optional.",
        example={"name": "Lee", "city": "Seoul"},
    ),
    SchemaCase(
        "app_config",  # booleans, enums and bounded integers, all optional but one
        {
            "type": "object",
            "properties": {
                "debug": {"type": "boolean"},
                "log_level": {"enum": ["debug", "info", "warning", "error"]},
                "workers": {"type": "integer", "minimum": 1, "maximum": 16},
                "theme": {"enum": ["light", "dark"]},
            },
            "required": ["debug"],
            "additionalProperties": False,
        },
        "Give a JSON configuration for a web app: debug on or off, log level, number of workers, theme.",
        example={"debug": False, "log_level": "info", "workers": 4},
    ),
    SchemaCase(
        "order_defs_ref",  # $defs reused through $ref
        {
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {"street": _str(40), "city": _str(30)},
                    "required": ["street", "city"],
                    "additionalProperties": False,
                },
                "line_item": {
                    "type": "object",
                    "properties": {
                        "product": _str(30),
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
                "items": {"type": "array", "items": {"$ref": "#/$defs/line_item"}, "minItems": 1, "maxItems": 3},
                "shipping": {"$ref": "#/$defs/address"},
                "billing": {"$ref": "#/$defs/address"},
            },
            "required": ["order_id", "items", "shipping", "billing"],
            "additionalProperties": False,
        },
        "Give a JSON order: an order id, one to three line items (product, quantity), shipping and billing addresses.",
        example={
            "order_id": 1042,
            "items": [{"product": "Lamp", "quantity": 2}],
            "shipping": {"street": "5 Main St", "city": "Springfield"},
            "billing": {"street": "5 Main St", "city": "Springfield"},
        },
    ),
    SchemaCase(
        "shop_booleans_nulls",
        {
            "type": "object",
            "properties": {
                "is_open": {"type": "boolean"},
                "has_parking": {"type": "boolean"},
                "closed_reason": {"type": "null"},
                "manager": {"type": ["string", "null"], "maxLength": 30},
            },
            "required": ["is_open", "has_parking", "closed_reason", "manager"],
            "additionalProperties": False,
        },
        "Give a JSON shop status: is it open, does it have parking, why it is closed (null), its manager or null.",
        example={"is_open": True, "has_parking": False, "closed_reason": None, "manager": None},
    ),
    SchemaCase(
        "leaderboard_top_level_array",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"player": _str(20), "score": {"type": "integer", "minimum": 0, "maximum": 1000}},
                "required": ["player", "score"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 5,
        },
        "Give a JSON array of up to five players on a leaderboard, each with a player name and a score.",
        example=[{"player": "zed", "score": 950}, {"player": "amy", "score": 870}],
    ),
    SchemaCase(
        "get_weather_arguments",  # OpenAI's function-calling example, strict mode
        {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "City and country e.g. Bogotá, Colombia",
                    "maxLength": 40,
                },
                "units": {
                    "type": ["string", "null"],
                    "enum": ["celsius", "fahrenheit", None],
                    "description": "Units the temperature will be returned in.",
                },
            },
            "required": ["location", "units"],
            "additionalProperties": False,
        },
        "Call get_weather for the weather in Paris, France, in celsius. Give only the JSON arguments.",
        example={"location": "Paris, France", "units": "celsius"},
    ),
    SchemaCase(
        "map_point_tuple",  # prefixItems: a fixed-length tuple
        {
            "type": "object",
            "properties": {
                "label": _str(30),
                "point": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "number", "minimum": -90, "maximum": 90},
                        {"type": "number", "minimum": -180, "maximum": 180},
                    ],
                    "items": False,
                    "minItems": 2,
                },
            },
            "required": ["label", "point"],
            "additionalProperties": False,
        },
        "Give a JSON map marker for the Eiffel Tower: a label and a [latitude, longitude] point.",
        example={"label": "Eiffel Tower", "point": [48.8584, 2.2945]},
    ),
    SchemaCase(
        "tic_tac_toe_nested_arrays",
        {
            "type": "object",
            "properties": {
                "board": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"enum": ["X", "O", " "]},
                        "minItems": 3,
                        "maxItems": 3,
                    },
                    "minItems": 3,
                    "maxItems": 3,
                },
                "next_player": {"enum": ["X", "O"]},
            },
            "required": ["board", "next_player"],
            "additionalProperties": False,
        },
        'Give a JSON tic-tac-toe position: a 3x3 board of "X", "O" or " " and whose turn is next.',
        example={"board": [["X", "O", " "], [" ", "X", " "], ["O", " ", " "]], "next_player": "X"},
    ),
    SchemaCase(
        "ticket_type_union",  # "type" as a list of types, and an enum mixing types
        {
            "type": "object",
            "properties": {
                "ticket": {"type": ["integer", "string"], "minimum": 1, "maximum": 99999, "maxLength": 12},
                "priority": {"enum": [1, 2, 3, "urgent", None]},
            },
            "required": ["ticket", "priority"],
            "additionalProperties": False,
        },
        'Give a JSON support ticket: its ticket number or code, and its priority (1, 2, 3, "urgent" or null).',
        example={"ticket": "INC-7", "priority": "urgent"},
    ),
    SchemaCase(
        "review_rating_enum",  # an integer enum, titles and descriptions
        {
            "title": "Review",
            "type": "object",
            "properties": {
                "product": {"title": "Product", "type": "string", "maxLength": 30},
                "stars": {"title": "Stars", "description": "From 1 to 5", "enum": [1, 2, 3, 4, 5]},
                "verdict": {"enum": ["recommend", "avoid"]},
                "summary": {"type": "string", "minLength": 5, "maxLength": 40},
            },
            "required": ["product", "stars", "verdict", "summary"],
            "additionalProperties": False,
        },
        "Give a JSON review of a coffee maker: product, stars from 1 to 5, a verdict and a one-line summary.",
        example={"product": "BrewMaster 3000", "stars": 4, "verdict": "recommend", "summary": "Fast and quiet."},
    ),
    SchemaCase(
        "recipe",  # arrays of objects and of strings together
        {
            "type": "object",
            "properties": {
                "name": _str(30),
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"item": _str(20), "grams": {"type": "integer", "minimum": 1, "maximum": 2000}},
                        "required": ["item", "grams"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 4,
                },
                "steps": {"type": "array", "items": _str(40), "minItems": 1, "maxItems": 3},
                "vegetarian": {"type": "boolean"},
            },
            "required": ["name", "servings", "ingredients", "steps", "vegetarian"],
            "additionalProperties": False,
        },
        "Give a JSON recipe for pancakes: name, servings, up to four ingredients with grams, up to three steps, "
        "and whether it is vegetarian.",
        example={
            "name": "Pancakes",
            "servings": 4,
            "ingredients": [{"item": "flour", "grams": 200}, {"item": "milk", "grams": 300}],
            "steps": ["Mix everything.", "Fry in a pan."],
            "vegetarian": True,
        },
    ),
    SchemaCase(
        "company_deep_nesting",  # four levels of objects
        {
            "type": "object",
            "properties": {
                "company": {
                    "type": "object",
                    "properties": {
                        "name": _str(30),
                        "department": {
                            "type": "object",
                            "properties": {
                                "name": _str(30),
                                "team": {
                                    "type": "object",
                                    "properties": {
                                        "name": _str(30),
                                        "lead": {
                                            "type": "object",
                                            "properties": {
                                                "name": _str(30),
                                                "years": {"type": "integer", "minimum": 0, "maximum": 50},
                                            },
                                            "required": ["name", "years"],
                                            "additionalProperties": False,
                                        },
                                    },
                                    "required": ["name", "lead"],
                                    "additionalProperties": False,
                                },
                            },
                            "required": ["name", "team"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "department"],
                    "additionalProperties": False,
                },
            },
            "required": ["company"],
            "additionalProperties": False,
        },
        "Give a JSON object for a company with one department, its team, and the team lead's name and years.",
        example={
            "company": {
                "name": "Acme",
                "department": {"name": "Research", "team": {"name": "Rockets", "lead": {"name": "Wile", "years": 7}}},
            }
        },
    ),
    SchemaCase(
        "calendar_attendees",  # an array of formatted strings, and a nullable date
        {
            "type": "object",
            "properties": {
                "event": _str(30),
                "day": {"type": "string", "format": "date"},
                "attendees": {
                    "type": "array",
                    "items": {"type": "string", "format": "email", "maxLength": 40},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "rsvp_by": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
            },
            "required": ["event", "day", "attendees", "rsvp_by"],
            "additionalProperties": False,
        },
        "Give a JSON calendar event: a name, the day, one to three attendee emails, and an RSVP date or null.",
        example={
            "event": "Launch party",
            "day": "2025-06-01",
            "attendees": ["a@example.com", "b@example.com"],
            "rsvp_by": None,
        },
    ),
    SchemaCase(
        "story_unbounded",
        {
            "type": "object",
            "properties": {"title": _str(40), "story": {"type": "string"}},
            "required": ["title", "story"],
            "additionalProperties": False,
        },
        "Write a short story about a robot as JSON with a title and the story.",
        bounded=False,
        example={"title": "Rusty", "story": "Rusty the robot learned to paint sunsets."},
    ),
    SchemaCase(
        "notes_unbounded",
        {
            "type": "object",
            "properties": {"topic": _str(30), "notes": {"type": "array", "items": {"type": "string"}}},
            "required": ["topic", "notes"],
            "additionalProperties": False,
        },
        "Give JSON study notes about photosynthesis: the topic and a list of notes.",
        bounded=False,
        example={"topic": "Photosynthesis", "notes": ["Plants turn light into sugar.", "Chlorophyll absorbs light."]},
    ),
]

assert len({case.name for case in SCHEMAS}) == len(SCHEMAS), "case names must be unique"
